"""Where a model spec resolves (an embedded model, a local folder, a GGUF file, or a hub
id already in the local Hugging Face cache; never a download), and what is refused there
before anything loads it: pickle weights, damaged safetensors or GGUF, shipped code."""

from __future__ import annotations

import struct
from pathlib import Path

from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.extras import require
from kvreplay.core.jsonio import read_json
from kvreplay.core.paths import check_name
from kvreplay.model.embedded import EMBEDDED, cache_root, convert_embedded
from kvreplay.model.gguf_metadata import check_metadata


def canonical_spec(spec: str) -> str:
    """One spelling per model source, so that ``./m/`` and ``./m`` are the same contract."""
    if spec in EMBEDDED or not spec.strip():
        return spec
    return str(Path(spec))


def resolve_source(spec: str, trust_remote_code: bool = False) -> tuple[Path, str | None]:
    """Map a model spec to (folder or hub id, gguf file name or None); a folder is checked
    (see :func:`check_folder`) before anything reads it."""
    if spec in EMBEDDED:
        return convert_embedded(EMBEDDED[spec]), None
    path = check_name(Path(spec).expanduser(), "The model path")
    if path.suffix == ".gguf":
        if not path.exists():
            raise KvreplayError(f"The GGUF file {spec!r} does not exist.")
        check_gguf(path, spec)
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvreplayError(f"The folder {spec!r} has no config.json, so it is not a model.")
        return check_folder(path, spec, trust_remote_code), None
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise KvreplayError(f"The model path {spec!r} is neither a model folder nor a GGUF file.")
    return check_folder(_from_hub_cache(spec), spec, trust_remote_code), None


def gguf_file(spec: str) -> Path:
    """The GGUF file of ``spec`` as shipped, for engines that run GGUF natively: the
    file itself, or an embedded model's (its parts joined once into the cache)."""
    if spec in EMBEDDED:
        embedded = EMBEDDED[spec]
        parts = embedded.part_paths()
        if len(parts) == 1:
            return parts[0]
        target = cache_root() / "gguf" / embedded.gguf_name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = target.with_name(target.name + ".staging")
            embedded.join_parts(parts, staging)
            staging.replace(target)
        return target
    path = check_name(Path(spec).expanduser(), "The model path")
    if path.suffix != ".gguf":
        raise KvreplayError(f"This backend runs GGUF files; {spec!r} is neither one nor embedded.")
    if not path.exists():
        raise KvreplayError(f"The GGUF file {spec!r} does not exist.")
    check_gguf(path, spec)
    return path


def check_gguf(path: Path, spec: str) -> None:
    """Refuse a GGUF file whose header does not parse or whose tensors run past its end,
    from the header alone: transformers would fail on it deep inside a load (a ``struct``
    error), and a file that is not a regular one (a FIFO) would block the read."""
    if not path.is_file():
        raise KvreplayError(f"The GGUF file {spec!r} is not a regular file.")
    require("hf", f"Reading the GGUF file {spec!r}", "transformers", "gguf")
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise KvreplayError(
            f"The GGUF file {spec!r} is damaged or truncated ({first_line(exc)})."
        ) from exc
    end = header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)
    if end > path.stat().st_size:
        raise KvreplayError(
            f"The GGUF file {spec!r} is truncated: its tensors need {end} bytes and it has "
            f"{path.stat().st_size}."
        )
    check_metadata(path, spec)


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_folder(folder: Path, spec: str, trust_remote_code: bool) -> Path:
    """Refuse a model folder that would fail later, or load unsafely: weights that are not
    readable safetensors (pickle weights are never loaded: unpickling runs code), and code
    shipped with the model unless ``trust_remote_code`` was asked for. Anything in the
    folder that is neither a file nor a folder (a FIFO, a device) is refused before a read
    blocks on it."""
    special = sorted(
        p.name for p in folder.iterdir() if p.exists() and not (p.is_file() or p.is_dir())
    )
    if special:
        raise KvreplayError(
            f"Model {spec!r} holds {special[0]}, which is not a regular file; remove it."
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for pattern in PICKLE_WEIGHTS for p in folder.glob(pattern))
        if pickled:
            raise KvreplayError(
                f"Model {spec!r} has only pickle weights ({pickled[0]}), which kvreplay never "
                "loads; convert them once with transformers: from_pretrained(folder) then "
                "save_pretrained(folder, safe_serialization=True)."
            )
        raise KvreplayError(f"Model {spec!r} has no *.safetensors weights.")
    from safetensors import SafetensorError, safe_open

    for path in weights:
        try:
            with safe_open(path, "numpy"):  # the header only: no torch needed
                pass
        except (SafetensorError, OSError) as exc:
            raise KvreplayError(
                f"The weights file {path.name} of model {spec!r} is damaged or truncated ({exc})."
            ) from exc
    config = read_json(folder / "config.json", f"the config of model {spec!r}")
    if not isinstance(config, dict):
        raise KvreplayError(f"The config of model {spec!r} is not a JSON object.")
    if "auto_map" in config and not trust_remote_code:
        raise KvreplayError(
            f"Model {spec!r} ships its own Python code (auto_map in config.json); pass "
            "--trust-remote-code to run it, only if you trust its source."
        )
    return folder


def _from_hub_cache(hub_id: str) -> Path:
    """A hub id resolves only from the local Hugging Face cache: kvreplay never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - every failure here means "not available offline"
        raise KvreplayError(
            f"Unknown model {hub_id!r}: it is not an embedded model ({', '.join(EMBEDDED)}), "
            "a local folder, a GGUF file, or a hub id already in the local Hugging Face cache."
        ) from exc
