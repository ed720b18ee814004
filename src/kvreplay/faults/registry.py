"""The fault suite, declared once (design: fault): each planted defect's name, the
engine it is planted in, the published bug it is shaped like, the code path it fires on
and when. The detection table (``bench/faults.py``) and the tests read this list; the
engine modules (:mod:`kvreplay.faults.vllm_engine`, :mod:`kvreplay.faults.llamacpp_engine`,
:mod:`kvreplay.faults.hf_engine`) implement one hook per name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvreplay.core.registry import Registry

ENV = "KVREPLAY_FAULT"
"""The one setting that enables a fault in an engine's process: the fault's name. Only
the fault hooks read it (vLLM's general plugin, :mod:`kvreplay.faults.plugin`); no run
folder, manifest or item file can set it."""

Engine = Literal["vllm", "llamacpp", "hf"]


@dataclass(frozen=True)
class Fault:
    """One planted defect: ``shaped_like`` names the real bug, ``path`` the engine code it
    hooks, ``fires`` when it changes anything."""

    name: str
    engine: Engine
    shaped_like: str
    path: str
    fires: str


FAULTS: tuple[Fault, ...] = (
    Fault(
        "vllm-hit-ulp",
        "vllm",
        "TensorRT-LLM #15503: block reuse changes the first token's logits",
        "model runner, before the forward of a request that hits the prefix cache: every K "
        "element of the blocks it hits, in every layer, moved up one unit in the last place",
        "every prefix-cache hit",
    ),
    Fault(
        "vllm-aligned-stale",
        "vllm",
        "SGLang #22819: KV corruption when the prefix length equals the block size",
        "model runner, after the forward of a hit on a block-aligned prompt: the last full "
        "block, which vLLM recomputes, is put back to what it held before (its write lost)",
        "a hit whose prompt length is a multiple of the block size",
    ),
    Fault(
        "vllm-hash-truncated",
        "vllm",
        "a prefix-cache block-hash collision: two different prefixes served from one block",
        "scheduler, kv_cache_utils.hash_block_tokens: a block's hash covers only the first "
        "half of its tokens",
        "two cached prefixes that agree on the first half of a block and differ after it",
    ),
    Fault(
        "vllm-stale-slot",
        "vllm",
        "vLLM PR #42245: a reused buffer not cleared, so results depend on request order",
        "model runner, after the forward of a hit: the first recomputed token's K/V slot "
        "is put back to what the block's previous user left there",
        "every prefix-cache hit (what it reads depends on the requests before)",
    ),
    Fault(
        "vllm-tail-position",
        "vllm",
        "llama.cpp #4902, #28527: a cached prompt's tail evaluated at another position",
        "model runner, _prepare_inputs of a hit's first step: the recomputed tail's "
        "positions shifted by one (RoPE of the wrong position, K/V written in place)",
        "every prefix-cache hit",
    ),
    Fault(
        "vllm-concurrent-race",
        "vllm",
        "a write race between requests batched in one step",
        "model runner, after a step that batches a hit's first forward with another "
        "request: the hit's first recomputed block takes the other request's first block",
        "a hit scheduled in the same step as another request",
    ),
    Fault(
        "vllm-evict-stale-hash",
        "vllm",
        "a block evicted and reused while its hash stays in the prefix-cache table",
        "scheduler, BlockPool._maybe_evict_cached_block: the hash entry is left behind, "
        "so a later lookup hits a block now holding another prompt's K/V",
        "a hit on blocks that were evicted and reallocated",
    ),
    Fault(
        "vllm-second-hit-lossy",
        "vllm",
        "LMCache #717: a lossy serialisation of cached KV, visible only on the second use",
        "model runner, before the forward of a hit: a block hit for the second time since "
        "it was written has its K/V rounded to 8-bit floats (e4m3)",
        "the second hit on the same blocks",
    ),
    Fault(
        "vllm-hit-temperature",
        "vllm",
        "sampling state not restored on a prefix-cache hit (seeded outputs that differ)",
        "model runner, _sample: a request that began with a hit has its logits divided by "
        "its temperature once more (temperature applied twice)",
        "a hit sampled at temperature > 0",
    ),
    Fault(
        "vllm-update-stale-cache",
        "vllm",
        "prime-rl PR #1650, NeMo-RL PR #4018, lmdeploy #4917: the prefix cache not reset "
        "after a weight update, so rollouts after a sync read K/V the old weights wrote",
        "model runner, reload_weights (the weight sync's load) and scheduler, "
        "reset_prefix_cache: the first reset after a reload is skipped (it reports success)",
        "a prompt cached before a weight update and sent again after it",
    ),
    Fault(
        "llamacpp-restore-perturbed",
        "llamacpp",
        "LMCache #717: cached KV serialised lossily, seen only when restored",
        "llama_state_set_data / llama_state_seq_set_data: the lowest bit of one K element "
        "of the last restored cell, layer 0, flipped",
        "every state restore (a replica's copy, a transplant's write)",
    ),
    Fault(
        "llamacpp-reeval-last",
        "llamacpp",
        "llama.cpp #4902, #28527: a cached prompt re-evaluates its last token differently",
        "llama_state_set_data: after a restore the last cached token is evaluated again "
        "at the next position, and every later position is shifted by one",
        "every full-context state restore (a replica's copy)",
    ),
    Fault(
        "llamacpp-prefill-logits-ulp",
        "llamacpp",
        "prompt logprobs that move with the batch shape, not the tokens",
        "llama_get_logits_ith after a multi-token llama_decode (the prefill path): the "
        "largest logit moved up one unit in the last place (no token can change)",
        "every prefill chunk of more than one token",
    ),
    Fault(
        "hf-lossy-cache",
        "hf",
        "a KV cache that stores lossily what the chunk itself attended to in full "
        "(quantized caches; LMCache #717)",
        "transformers DynamicLayer.update: the stored K/V rounded to 8-bit floats (e4m3) "
        "while the current forward attends to them unrounded",
        "every forward (a prefill's chunk reads itself unrounded, a decode step reads rounded K/V)",
    ),
)

BY_NAME: Registry[Fault] = Registry("fault", lambda: (("faults/registry.py", f) for f in FAULTS))


def get(name: str) -> Fault:
    """The fault of that name, or a one-sentence refusal (a second fault of one name is
    refused too, as every registry's)."""
    return BY_NAME.get(name)
