"""What a model's config must say before anything is built from it.

transformers accepts configs it cannot build a model from (an unknown rope type or
activation only warns, or fails deep inside the build with a bare ``KeyError``), and
accepts ones whose model would run wrong (an EOS id outside the vocabulary is only a
warning: decoding would never stop on it). Each such config is refused here, in one
sentence naming the model and the field, before a run writes its manifest.
"""

from __future__ import annotations

from typing import Any

from kvreplay.core.errors import KvreplayError, first_line

# Sizes a decoder's config may give; each one given must be a positive integer.
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
ACTIVATIONS = ("hidden_act", "hidden_activation")


def config_refusal(spec: str, exc: BaseException) -> KvreplayError:
    """transformers' refusal of a config as one sentence. Its strict-dataclass errors put
    the field and the reason on their last line (the first names only the validator)."""
    from huggingface_hub.errors import StrictDataclassError

    reason = first_line(exc)
    if isinstance(exc, StrictDataclassError):
        reason = str(exc).strip().splitlines()[-1].strip()[:160].rstrip(".")
    return KvreplayError(
        f"The config.json of model {spec!r} is not one transformers accepts ({reason})."
    )


def check_architecture(spec: str, config: Any, generation: Any = None) -> None:
    """Refuse a config (and its folder's generation config) that no model can be built
    from or run with: sizes that are not positive integers, attention heads that do not
    split the hidden size, an unknown rope type or activation, special token ids outside
    the vocabulary."""
    text = config.get_text_config(decoder=True)
    for name in SIZES:
        value = getattr(text, name, None)
        if value is not None and (type(value) is not int or value < 1):
            raise _field(spec, name, value, "a positive integer")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "head_dim", None) is None and text.hidden_size % heads:
        raise _field(
            spec, "hidden_size", text.hidden_size, f"a multiple of num_attention_heads ({heads})"
        )
    if heads % kv_heads:
        raise _field(
            spec, "num_attention_heads", heads, f"a multiple of num_key_value_heads ({kv_heads})"
        )
    _check_rope(spec, getattr(text, "rope_parameters", None))
    _check_activation(spec, text)
    _check_token_ids(spec, text.to_dict(), text.vocab_size, "config.json")
    if generation is not None:
        _check_token_ids(spec, generation.to_dict(), text.vocab_size, "generation_config.json")


def _field(spec: str, name: str, value: Any, wanted: str) -> KvreplayError:
    return KvreplayError(
        f"The config.json of model {spec!r} gives {name} {value!r}; it must be {wanted}."
    )


def _check_rope(spec: str, parameters: Any) -> None:
    """One rope type per layer kind (or one for all); each must be one transformers knows."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(parameters, dict):
        return
    nested = all(isinstance(v, dict) or v is None for v in parameters.values())
    for entry in parameters.values() if nested and parameters else [parameters]:
        kind = (entry or {}).get("rope_type", (entry or {}).get("type", "default"))
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
            raise _field(spec, "rope_type", kind, f"one of {known}")


def _check_activation(spec: str, text: Any) -> None:
    from transformers.activations import ACT2FN

    for name in ACTIVATIONS:
        value = getattr(text, name, None)
        if isinstance(value, str) and value not in ACT2FN:
            raise _field(spec, name, value, "an activation transformers knows")


def _check_token_ids(spec: str, fields: dict[str, Any], vocab_size: int, file: str) -> None:
    """Every special token id must name a row of the embedding. Negative ids other than
    EOS are left alone: published configs use -1 for "none", and nothing looks them up."""
    for name, value in sorted(fields.items()):
        if not name.endswith("_token_id") or value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            low = 0 if name == "eos_token_id" else -vocab_size
            if type(token) is not int or not low <= token < vocab_size:
                raise KvreplayError(
                    f"The {file} of model {spec!r} gives {name} {token!r}, outside the "
                    f"vocabulary of {vocab_size} tokens."
                )
