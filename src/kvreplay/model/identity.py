"""What a run records about a model's files, so that a resume or an audit refuses other
weights, config, tokenizer, chat template or special tokens: the digests of every file
(read in full, beside the load), under each identity scheme a run may have recorded."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.core.canonical import sha256_json
from kvreplay.core.errors import KvreplayError

IDENTITY_SCHEME = 3  # see ModelIdentity


def identity_scheme(contract_scheme: int) -> int:
    """The identity scheme a contract scheme records its model under: its own up to 3;
    contract scheme 4 changed what it records of the machine, not of the model."""
    return min(contract_scheme, IDENTITY_SCHEME)


# The key transformers stamps into every config it saves: the version of the writer, not
# a property of the model.
TOOL_STAMP = "transformers_version"


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


def sha256_file(path: Path) -> str:
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
    return {path.name: sha256_file(path) for path in files}


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
