"""transformers loading: a causal LM at a named dtype, in eval mode, with what a ledger
must record of how it was loaded; and the checks that refuse, before a run writes
anything, a model transformers could not build or whose weights do not fit its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.model.identity import ModelIdentity, hash_model_files, model_identity
from kvreplay.model.precision import parse_device, parse_dtype, torch_dtype
from kvreplay.model.reading import model_config, pretrained, tokenizer_at


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
    loaded: str = "cast"  # cast, or pretrained: as from_pretrained left it
    kept: tuple[str, ...] = ()  # the floating tensors left at another dtype (pretrained)

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
        from kvreplay.backends.hf.state import HfState

        return HfState.empty(self.model, construction)

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
            "loaded": self.loaded,
            "kept_dtype": list(self.kept),
            **self.identity.describe(),
        }


def check_loadable(spec: str, attn_implementation: str, trust_remote_code: bool = False) -> None:
    """Refuse, before a run writes anything, what would otherwise go wrong only when a
    worker loads the model: an attention implementation transformers cannot use here,
    and weights that do not fit the config (see :func:`check_loading_info`).

    The model is built on the meta device, so no weight stays in memory.
    """
    from transformers import AutoModelForCausalLM

    _check_buildable(spec, attn_implementation, trust_remote_code)
    source, gguf_file, kwargs = pretrained(spec, trust_remote_code)
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


def _check_buildable(spec: str, attn_implementation: str, trust_remote_code: bool) -> None:
    """The model built from its config on the meta device with this attention, or the
    sentence that says why not."""
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


def cpu_flash_unusable() -> bool:
    """Whether torch's CPU flash attention cannot run bf16 or fp16 here: it packs its
    operands for AMX whenever the CPU has AMX tiles, with packing code compiled only into
    its AVX-512 kernels, so below them (``ATEN_CPU_CAPABILITY=avx2`` or ``default`` on
    such a CPU) it raises "pack_vnni2 is only supported when avx512 is supported". There
    kvreplay runs sdpa's math kernel instead (a choice the recorded CPU features and
    capability determine; the backend's kernel report says so)."""
    return bool(torch.cpu._is_amx_tile_supported()) and not (
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    )


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str = "bf16",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    device_map: str | None = None,
    cast: bool = True,
) -> LoadedModel:
    """Load ``spec`` in eval mode at ``dtype`` on ``device`` with the given attention.

    ``device_map`` (e.g. ``"auto"``) spreads a model too large for one GPU over every
    visible GPU instead of moving it whole to ``device``. With ``cast`` (every run's
    way) every floating tensor is then cast to ``dtype``, the rotary ``inv_freq``
    buffer too; without, the model stays as ``from_pretrained(dtype=...)`` left it, as
    a trainer loads it: the tensors it keeps at another dtype are recorded (``kept``).
    """
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    if device == "cpu" and attn_implementation == "sdpa" and cpu_flash_unusable():
        torch.backends.cuda.enable_flash_sdp(False)  # CPU sdpa honours it: the math kernel
    source, gguf_file, kwargs = pretrained(spec, trust_remote_code)
    digests = hash_model_files(source, gguf_file)  # while transformers imports and loads
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer_at(spec, source, gguf_file, kwargs)
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
        model = model.to(device=device, dtype=torch_dtype(dtype)) if cast else model.to(device)
    model = model.eval()
    floating = [*model.named_parameters(), *model.named_buffers()]
    kept = tuple(
        name for name, t in floating if t.is_floating_point() and t.dtype != torch_dtype(dtype)
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        dtype_name=dtype,
        device=device,
        attn_implementation=str(model.config._attn_implementation),
        identity=model_identity(digests.result(), gguf_file, tokenizer),
        loaded="cast" if cast else "pretrained",
        kept=kept,
    )
