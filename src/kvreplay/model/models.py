"""Load a causal LM and its tokenizer from wherever its spec resolves (see
:mod:`kvreplay.model.sources`) at a named dtype, and record what was loaded (digests,
attention); or read just its config, tokenizer and identity, without the weights.

Reading a model (config, tokenizer, identity) imports no torch, and where transformers
is not installed (the core install) reads the folder itself (:mod:`kvreplay.model.folder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.extras import missing
from kvreplay.model import folder as plain
from kvreplay.model.architecture import check_architecture, config_refusal
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.model.identity import IDENTITY_SCHEME, ModelIdentity, hash_model_files, model_identity
from kvreplay.model.precision import parse_device, parse_dtype, torch_dtype
from kvreplay.model.quiet import quiet_transformers
from kvreplay.model.sources import resolve_source

if TYPE_CHECKING:
    import torch


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
        return torch_dtype(self.dtype_name)

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
        from kvreplay.model.state import BoundaryState

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
    """The model's config, without the weights, once it is one a model can be built from
    and run with (see :mod:`kvreplay.model.architecture`)."""
    from transformers import AutoConfig

    source, gguf_file, kwargs = _pretrained(spec, trust_remote_code)
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
    return _tokenizer(spec, *_pretrained(spec, trust_remote_code))


def _folder(spec: str, trust_remote_code: bool) -> Path:
    """The model folder that the core install reads (a GGUF file's tokenizer and config
    are read by transformers only)."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    if gguf_file:
        raise plain.needs_hf(spec, "is a GGUF file")
    return source


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


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
    except Exception as exc:  # noqa: BLE001 - a GGUF's metadata fails its conversion in many ways
        if not gguf_file:
            raise
        raise KvreplayError(
            f"Could not read the tokenizer of the GGUF file {spec!r} ({type(exc).__name__}: "
            f"{first_line(exc)})."
        ) from exc


def _pretrained(spec: str, trust_remote_code: bool) -> tuple[Path, str | None, dict[str, Any]]:
    """Where ``spec`` lives and the keyword arguments every ``from_pretrained`` gets."""
    source, gguf_file = resolve_source(spec, trust_remote_code)
    quiet_transformers()
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return source, gguf_file, kwargs


def check_loadable(spec: str, attn_implementation: str, trust_remote_code: bool = False) -> None:
    """Refuse, before a run writes anything, what would otherwise go wrong only when a
    worker loads the model: an attention implementation transformers cannot use here,
    and weights that do not fit the config (see :func:`check_loading_info`).

    The model is built on the meta device, so no weight stays in memory.
    """
    import torch
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
                f"({first_line(exc)})."
            ) from exc
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = ", ".join(["eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())])
        raise KvreplayError(
            f"--attn {attn_implementation} is not an attention implementation transformers "
            f"knows; use one of {known}."
        ) from exc
    except ImportError as exc:
        raise KvreplayError(
            f"--attn {attn_implementation} cannot be used here: {first_line(exc)}."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - built on meta from the config alone: it is at fault
        raise KvreplayError(
            f"Model {spec!r} is not a causal language model transformers can build from its "
            f"config.json ({type(exc).__name__}: {first_line(exc)})."
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
        raise KvreplayError(f"Could not load model {spec!r}: {first_line(exc)}.") from exc
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
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation,
            device_map=device_map,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in info, and refused below
            **kwargs,
        )
    except KvreplayError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise KvreplayError(f"Could not load model {spec!r}: {first_line(exc)}.") from exc
    check_loading_info(spec, info)
    if gguf_file and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if device_map is None:
        model = model.to(device=device, dtype=torch_dtype(dtype))
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
