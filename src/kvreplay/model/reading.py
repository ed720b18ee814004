"""A model read without its weights, whichever backend runs it: its config (checked as
one a model can be built from and run with), its tokenizer and its identity, from
wherever its spec resolves (:mod:`kvreplay.model.sources`).

Reading imports no torch, and where transformers is not installed (the core install)
reads the folder itself (:mod:`kvreplay.model.folder`); loading the weights is the hf
backend's (:mod:`kvreplay.backends.hf.loading`).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.extras import missing
from kvreplay.model import folder as plain
from kvreplay.model.architecture import check_architecture, config_refusal
from kvreplay.model.identity import (
    IDENTITY_SCHEME,
    ModelIdentity,
    hash_model_files,
    identity_scheme,
    model_identity,
)
from kvreplay.model.quiet import quiet_transformers
from kvreplay.model.sources import resolve_source

if TYPE_CHECKING:
    pass


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
    scheme it started with; ``scheme`` is the run's contract scheme, see
    :func:`~kvreplay.model.identity.identity_scheme`); every worker checks that the model
    it loads matches.
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
        **identity.describe(identity_scheme(scheme)),
    }


def model_config(spec: str, trust_remote_code: bool = False) -> Any:
    """The model's config, without the weights, once it is one a model can be built from
    and run with (see :mod:`kvreplay.model.architecture`). A command reads it several
    times (admission, each engine): it is parsed once per version of the model's files
    and each caller gets its own copy."""
    source, gguf_file, _ = pretrained(spec, trust_remote_code)
    config = source / (gguf_file or "config.json")
    signature = (config.stat().st_mtime_ns, config.stat().st_size) if config.is_file() else None
    return copy.deepcopy(_parsed_config(spec, trust_remote_code, signature))


@functools.lru_cache(maxsize=8)
def _parsed_config(spec: str, trust_remote_code: bool, signature: Any) -> Any:
    """:func:`model_config`, parsed (``signature``: the config file's version)."""
    from transformers import AutoConfig

    source, gguf_file, kwargs = pretrained(spec, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the folder is the only input: its config is at fault
        raise config_refusal(spec, exc) from exc
    check_architecture(spec, config, None if gguf_file else generation_config(source))
    return config


def text_config(spec: str, trust_remote_code: bool = False) -> Any:
    """The decoder's config (layers, context window, vocabulary), without the weights."""
    if missing("transformers"):
        return plain.text_config(_folder(spec, trust_remote_code), spec)
    return model_config(spec, trust_remote_code).get_text_config(decoder=True)


def vocabulary_size(config: Any, tokenizer: Any) -> int:
    """The token ids a model can take and produce: its config's vocabulary, else the
    tokenizer's."""
    return int(getattr(config, "vocab_size", 0) or 0) or len(tokenizer)


def generation_config(folder: Path) -> Any:
    """A model folder's generation config (its EOS ids), or None when it has none."""
    if missing("transformers"):
        return plain.generation_config(folder)
    from transformers import GenerationConfig

    if not (folder / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - the file is the only input: it is at fault
        raise KvreplayError(
            f"The generation_config.json of model folder {str(folder)!r} is not one "
            f"transformers accepts ({first_line(exc)})."
        ) from exc


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Any:
    """Just the tokenizer (for selections that must not wait for a model load)."""
    if missing("transformers"):
        return plain.FolderTokenizer(_folder(spec, trust_remote_code), spec)
    return tokenizer_at(spec, *pretrained(spec, trust_remote_code))


def _folder(spec: str, trust_remote_code: bool) -> Path:
    """The model folder that the core install reads (a GGUF file's tokenizer and config
    are read by transformers only)."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    if gguf_file:
        raise plain.needs_hf(spec, "is a GGUF file")
    return source


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def tokenizer_at(spec: str, source: Path, gguf_file: str | None, kwargs: dict[str, Any]) -> Any:
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
    except Exception as exc:  # noqa: BLE001 - a GGUF's metadata fails its conversion in many ways
        if not gguf_file:
            raise
        raise KvreplayError(
            f"Could not read the tokenizer of the GGUF file {spec!r} ({type(exc).__name__}: "
            f"{first_line(exc)})."
        ) from exc


def pretrained(spec: str, trust_remote_code: bool) -> tuple[Path, str | None, dict[str, Any]]:
    """Where ``spec`` lives and the keyword arguments every ``from_pretrained`` gets."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    quiet_transformers()
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return source, gguf_file, kwargs
