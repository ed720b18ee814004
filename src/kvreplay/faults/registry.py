"""The fault suite, declared once (design: fault): each planted defect's name, the
function that plants it (its *hook*, ``module:function`` under :mod:`kvreplay.faults`,
loaded when the fault is planted), the engine it is planted in, the published bug it is
shaped like, the code path it fires on and when. The detection table, the docs' fault
table (:mod:`kvreplay.faults.tables`) and the tests read this list, and nothing else
names a fault."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvreplay.core.registry import Registry, load
from kvreplay.faults.patches import Patch

ENV = "KVREPLAY_FAULT"
"""The one setting that enables a fault in an engine's process: the fault's name. Only
vLLM's general plugin (:mod:`kvreplay.faults.plugin`) reads it, in a process whose path
holds the plugin folder; no run folder, manifest or item file can set it."""

Engine = Literal["vllm", "llamacpp", "hf"]

OPTIONS: dict[str, tuple[str, ...]] = {
    "default": (),
    "bitwise": ("--expect", "bitwise"),
    "fragile": ("--select", "fragile"),
    "traffic": ("--traffic", "2"),
    "max-rate": ("--max-rate", "0.05"),
    "sampled": ("--temperature", "0.7"),
    "update": ("--update", "perturb:0.05:1"),
}
"""The check options the detection table measures, by name: the words each adds to
``kvreplay check`` (``history`` is a run of the history experiment on a server)."""


@dataclass(frozen=True)
class Fault:
    """One planted defect: ``hook`` is the function (``module:function`` under
    :mod:`kvreplay.faults`) that returns its patches, ``shaped_like`` names the real bug,
    ``path`` the engine code it hooks, ``fires`` when it changes anything, ``caught_by``
    the check option that catches it on the engine's tiny test model (the tests plant
    each fault and hold the check to it): ``default``, or a key of :data:`OPTIONS`."""

    name: str
    hook: str
    engine: Engine
    shaped_like: str
    path: str
    fires: str
    caught_by: str = "default"  # the check option that catches it (its tests hold it to that)

    def patches(self) -> list[Patch]:
        """The fault's patches, made by its hook (importing its engine)."""
        make: Callable[[], list[Patch]] = load(f"kvreplay.faults.{self.hook}")
        return make()


FAULTS: tuple[Fault, ...] = (
    Fault(
        "vllm-hit-ulp",
        "vllm_engine:hit_ulp",
        "vllm",
        "TensorRT-LLM #15503: block reuse changes the first token's logits",
        "model runner, before the forward of a request that hits the prefix cache: every K "
        "element of the blocks it hits, in every layer, moved up one unit in the last place",
        "every prefix-cache hit",
    ),
    Fault(
        "vllm-aligned-stale",
        "vllm_engine:aligned_stale",
        "vllm",
        "SGLang #22819: KV corruption when the prefix length equals the block size",
        "model runner, after the forward of a hit on a block-aligned prompt: the last full "
        "block, which vLLM recomputes, is put back to what it held before (its write lost)",
        "a hit whose prompt length is a multiple of the block size",
    ),
    Fault(
        "vllm-hash-truncated",
        "vllm_engine:hash_truncated",
        "vllm",
        "a prefix-cache block-hash collision: two different prefixes served from one block",
        "scheduler, kv_cache_utils.hash_block_tokens: a block's hash covers only the first "
        "half of its tokens",
        "two cached prefixes that agree on the first half of a block and differ after it",
    ),
    Fault(
        "vllm-stale-slot",
        "vllm_engine:stale_slot",
        "vllm",
        "a reused K/V slot not cleared, so results depend on request order",
        "model runner, after the forward of a hit: the first recomputed token's K/V slot "
        "is put back to what the block's previous user left there",
        "every prefix-cache hit (what it reads depends on the requests before)",
    ),
    Fault(
        "vllm-tail-position",
        "vllm_engine:tail_position",
        "vllm",
        "llama.cpp #4902, #28527: a cached prompt's tail evaluated at another position",
        "model runner, _prepare_inputs of a hit's first step: the recomputed tail's "
        "positions shifted by one (RoPE of the wrong position, K/V written in place)",
        "every prefix-cache hit",
    ),
    Fault(
        "vllm-concurrent-race",
        "vllm_engine:concurrent_race",
        "vllm",
        "a write race between requests batched in one step",
        "model runner, after a step that batches a hit's first forward with another "
        "request: the hit's first recomputed block takes the other request's first block",
        "a hit scheduled in the same step as another request",
    ),
    Fault(
        "vllm-evict-stale-hash",
        "vllm_engine:evict_stale_hash",
        "vllm",
        "a block evicted and reused while its hash stays in the prefix-cache table",
        "scheduler, BlockPool._maybe_evict_cached_block: the hash entry is left behind, "
        "so a later lookup hits a block now holding another prompt's K/V",
        "a hit on blocks that were evicted and reallocated",
    ),
    Fault(
        "vllm-second-hit-lossy",
        "vllm_engine:second_hit_lossy",
        "vllm",
        "LMCache #717: a lossy serialisation of cached KV, visible only on the second use",
        "model runner, before the forward of a hit: a block hit for the second time since "
        "it was written has its K/V rounded to 8-bit floats (e4m3)",
        "the second hit on the same blocks",
    ),
    Fault(
        "vllm-hit-temperature",
        "vllm_engine:hit_temperature",
        "vllm",
        "sampling state not restored on a prefix-cache hit (seeded outputs that differ)",
        "model runner, _sample: a request that began with a hit has its logits divided by "
        "its temperature once more (temperature applied twice)",
        "a hit sampled at temperature > 0",
    ),
    Fault(
        "vllm-hit-before-write",
        "vllm_engine:hit_before_write",
        "vllm",
        "vLLM PR #38715: a prefix-cache block hit before its K/V is written",
        "model runner, after a step in which a hit reads blocks another request of the "
        "same step writes: those blocks put back to what they held before the step",
        "a hit scheduled in the same step as the request that writes its blocks",
    ),
    Fault(
        "vllm-evict-before-pin",
        "vllm_engine:evict_before_pin",
        "vllm",
        "vLLM PR #37164: a cached block evicted between the lookup and the pin",
        "scheduler, KVCacheManager.allocate_slots: a found block still at the head of the "
        "free queue is handed out again as one of the request's new blocks",
        "a hit on blocks that are the next the free queue hands out",
    ),
    Fault(
        "vllm-hash-drops-salt",
        "vllm_engine:hash_drops_salt",
        "vllm",
        "vLLM GHSA-rm76-4mrf-v9r8, #44701, PR #42495: an extra key (cache_salt, LoRA id, "
        "multimodal hash) dropped from the block hash",
        "scheduler, kv_cache_utils.generate_block_hash_extra_keys: the cache_salt key dropped",
        "prompts that agree but carry different cache_salt values",
    ),
    Fault(
        "vllm-one-block-prefix",
        "vllm_engine:one_block_prefix",
        "vllm",
        "SGLang #22819: KV corruption when the cached prefix is exactly one block",
        "model runner, before the forward of a hit that reads exactly one block: that "
        "block's K/V rounded to 8-bit floats (e4m3)",
        "a hit whose cached prefix is exactly one block long",
    ),
    Fault(
        "vllm-logprobs-stale",
        "vllm_engine:logprobs_stale",
        "vllm",
        "vLLM PR #42245: a logprobs buffer not cleared between requests",
        "model runner, _sample: a request that starts on a hit reports, at its first step, "
        "the logprobs its batch row held the step before (its tokens unchanged)",
        "the first step of every prefix-cache hit",
    ),
    Fault(
        "vllm-reset-keeps-table",
        "vllm_engine:reset_keeps_table",
        "vllm",
        "a phantom hit after the pool was fully evicted: a reset that leaves the prefix "
        "table in place",
        "scheduler, BlockPool.reset_prefix_cache: reports success and keeps every hash",
        "every request after a reset whose prefix was cached before it",
    ),
    Fault(
        "vllm-resume-position",
        "vllm_engine:resume_position",
        "vllm",
        "vLLM's recompute after preemption: a resumed request's positions off by one",
        "model runner, _prepare_inputs of a resumed request's step: its recomputed tokens' "
        "positions shifted by one",
        "a request preempted and resumed (a pool too small for the batch)",
    ),
    Fault(
        "vllm-update-stale-cache",
        "vllm_engine:update_stale_cache",
        "vllm",
        "prime-rl PR #1650, NeMo-RL PR #4018, lmdeploy #4917: the prefix cache not reset "
        "after a weight update, so rollouts after a sync read K/V the old weights wrote",
        "engine core, collective_rpc('reload_weights') (the weight sync's load) and "
        "scheduler, reset_prefix_cache: the first reset after a reload is skipped (it "
        "reports success)",
        "a prompt cached before a weight update and sent again after it",
        caught_by="update",
    ),
    Fault(
        "llamacpp-restore-perturbed",
        "llamacpp_engine:restore_perturbed",
        "llamacpp",
        "LMCache #717: cached KV serialised lossily, seen only when restored",
        "llama_state_set_data / llama_state_seq_set_data: the lowest bit of one K element "
        "of the last restored cell, layer 0, flipped",
        "every state restore (a replica's copy, a transplant's write)",
    ),
    Fault(
        "llamacpp-reeval-last",
        "llamacpp_engine:reeval_last",
        "llamacpp",
        "llama.cpp #4902, #28527: a cached prompt re-evaluates its last token differently",
        "llama_state_set_data: after a restore the last cached token is evaluated again "
        "at the next position, and every later position is shifted by one",
        "every full-context state restore (a replica's copy)",
    ),
    Fault(
        "llamacpp-prefill-logits-ulp",
        "llamacpp_engine:prefill_logits_ulp",
        "llamacpp",
        "prompt logprobs that move with the batch shape, not the tokens",
        "llama_get_logits_ith after a multi-token llama_decode (the prefill path): the "
        "largest logit moved up one unit in the last place (no token can change)",
        "every prefill chunk of more than one token",
        caught_by="bitwise",
    ),
    Fault(
        "hf-lossy-cache",
        "hf_engine:lossy_cache",
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
