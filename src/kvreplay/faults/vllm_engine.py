"""The vLLM faults (design: fault), each a hook on one real code path of vLLM's engine:
the scheduler's block hashing and block pool, and the model runner's step (what a
request hit, the K/V blocks the step reads and writes, its positions, its sampler).

The hooks patch vLLM's own classes in the process that runs them: the engine core's (the
scheduler and, with one CPU worker, the model runner too), where vLLM's general plugin
(:mod:`kvreplay.faults.plugin`) installs the fault that ``KVREPLAY_FAULT`` names, or the
test's own process for an in-process engine (:func:`kvreplay.faults.planted`).

The K/V blocks are the engine's own tensors (``static_forward_context[layer].kv_cache``,
as vLLM's ``_zero_block_ids`` reaches them): ``[blocks, kv_heads, block_size, 2 *
head_dim]`` on CPU, each block holding K channel-major then V token-major per head (the
'vec' kernel's layout, :mod:`kvreplay.backends.vllm.blocks`); only the slot fault needs
that layout, the others move whole blocks or single elements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvreplay.faults.numerics import lossy, one_ulp_up
from kvreplay.faults.patches import Patch


@dataclass(frozen=True)
class Hit:
    """A request in a step whose first ``cached`` tokens the prefix cache served."""

    req_id: str
    blocks: list[int]  # its blocks (the first KV-cache group's)
    cached: int
    prompt: int


def new_hits(scheduler_output: Any) -> list[Hit]:
    """The requests of a step that start on a prefix-cache hit."""
    return [
        Hit(r.req_id, list(r.block_ids[0]), r.num_computed_tokens, len(r.prompt_token_ids or ()))
        for r in scheduler_output.scheduled_new_reqs
        if r.num_computed_tokens > 0
    ]


def caches(runner: Any) -> list[torch.Tensor]:
    """Each layer's KV-cache tensor, in layer order."""
    context = runner.compilation_config.static_forward_context
    names = runner.kv_cache_config.kv_cache_groups[0].layer_names
    return [context[name].kv_cache for name in names]


def block_size(runner: Any) -> int:
    return int(runner.cache_config.block_size)


def key_value(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a block's K (``[kv_heads, head_dim, block_size]``) and V (``[kv_heads,
    block_size, head_dim]``), the 'vec' layout of ``[kv_heads, block_size, 2 * head_dim]``."""
    heads, size, width = block.shape
    dim = width // 2
    halves = block.view(heads, 2, size * dim)
    return halves[:, 0].view(heads, dim, size), halves[:, 1].view(heads, size, dim)


def slot(block: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one token's K and V in a block."""
    keys, values = key_value(block)
    return keys[:, :, token], values[:, token, :]


def step_hook(
    before: Callable[[Any, Any], Any] | None = None,
    after: Callable[[Any, Any, Any], None] | None = None,
) -> Patch:
    """A hook on the model runner's step: ``before(runner, scheduler_output)`` runs ahead
    of the forward and returns what ``after(runner, scheduler_output, kept)`` gets once
    the forward has written its K/V."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            kept = before(self, scheduler_output) if before else None
            result = original(self, scheduler_output, *args, **kwargs)
            if after is not None:
                after(self, scheduler_output, kept)
            return result

        return execute_model

    return (GPUModelRunner, "execute_model", make)


# --- one function per fault: the patches it installs ---------------------------------


def hit_ulp() -> list[Patch]:
    def before(runner: Any, output: Any) -> None:
        size = block_size(runner)
        for hit in new_hits(output):
            for block in hit.blocks[: hit.cached // size]:
                for cache in caches(runner):
                    one_ulp_up(key_value(cache[block])[0])

    return [step_hook(before)]


def write_lost(blocks: Callable[[Any, Any], list[int]]) -> Patch:
    """A step hook that puts ``blocks(runner, scheduler_output)`` back, once the step
    ran, to what they held before it: the step's writes to them lost."""

    def before(runner: Any, output: Any) -> list[tuple[int, list[torch.Tensor]]]:
        return [(b, [cache[b].clone() for cache in caches(runner)]) for b in blocks(runner, output)]

    def after(runner: Any, output: Any, kept: list[tuple[int, list[torch.Tensor]]]) -> None:
        for block, old in kept:
            for cache, saved in zip(caches(runner), old, strict=True):
                cache[block].copy_(saved)

    return step_hook(before, after)


def aligned_stale() -> list[Patch]:
    def recomputed(runner: Any, output: Any) -> list[int]:
        size = block_size(runner)
        return [
            hit.blocks[hit.cached // size]
            for hit in new_hits(output)
            if hit.prompt % size == 0 and hit.cached == hit.prompt - size
        ]

    return [write_lost(recomputed)]


def hash_truncated() -> list[Patch]:
    from vllm.v1.core import kv_cache_utils

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def hash_block_tokens(function: Any, parent: Any, tokens: Any, extra: Any = None) -> Any:
            return original(function, parent, list(tokens)[: len(tokens) // 2], extra)

        return hash_block_tokens

    return [(kv_cache_utils, "hash_block_tokens", make)]


def stale_slot() -> list[Patch]:
    def before(runner: Any, output: Any) -> list[tuple[int, list[tuple[torch.Tensor, ...]]]]:
        size, kept = block_size(runner), []
        for hit in new_hits(output):
            block = hit.blocks[hit.cached // size]
            old = [tuple(t.clone() for t in slot(cache[block], 0)) for cache in caches(runner)]
            kept.append((block, old))
        return kept

    def after(runner: Any, output: Any, kept: list[Any]) -> None:
        for block, old in kept:
            for cache, saved in zip(caches(runner), old, strict=True):
                for view, value in zip(slot(cache[block], 0), saved, strict=True):
                    view.copy_(value)

    return [step_hook(before, after)]


def tail_position() -> list[Patch]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, scheduler_output, *args, **kwargs)
            starts = self.query_start_loc.np
            for hit in new_hits(scheduler_output):
                index = self.input_batch.req_id_to_index[hit.req_id]
                self.positions[int(starts[index]) : int(starts[index + 1])] += 1
            return result

        return _prepare_inputs

    return [(GPUModelRunner, "_prepare_inputs", make)]


def concurrent_race() -> list[Patch]:
    def before(runner: Any, output: Any) -> list[tuple[int, str]]:
        if len(output.num_scheduled_tokens) < 2:
            return []
        size, kept = block_size(runner), []
        for hit in new_hits(output):
            other = next(r for r in output.num_scheduled_tokens if r != hit.req_id)
            kept.append((hit.blocks[hit.cached // size], other))
        return kept

    def after(runner: Any, output: Any, kept: list[tuple[int, str]]) -> None:
        for block, other in kept:
            source = runner.requests[other].block_ids[0][0]
            for cache in caches(runner):
                cache[block].copy_(cache[source])

    return [step_hook(before, after)]


def evict_stale_hash() -> list[Patch]:
    from vllm.v1.core.block_pool import BlockPool

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
            known = self.cached_block_hashes_by_block.pop(block.block_id, ())
            if block.block_hash is None and not known:
                return False
            block.reset_hash()  # the block forgets its hash; the table keeps it
            return True

        return _maybe_evict_cached_block

    return [(BlockPool, "_maybe_evict_cached_block", make)]


def second_hit_lossy() -> list[Patch]:
    hits: dict[int, int] = {}  # block id -> hits since it was last allocated

    def before(runner: Any, output: Any) -> None:
        size = block_size(runner)
        for request in output.scheduled_new_reqs:
            for block in request.block_ids[0][request.num_computed_tokens // size :]:
                hits[block] = 0
        for blocks in output.scheduled_cached_reqs.new_block_ids:
            for block in (blocks or ([],))[0]:
                hits[block] = 0
        for hit in new_hits(output):
            for block in hit.blocks[: hit.cached // size]:
                hits[block] = hits.get(block, 0) + 1
                if hits[block] == 2:
                    for cache in caches(runner):
                        cache[block].copy_(lossy(cache[block]))

    return [step_hook(before)]


def hit_temperature() -> list[Patch]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    started: set[str] = set()  # requests that began with a prefix-cache hit

    def before(runner: Any, output: Any) -> None:
        started.difference_update(output.finished_req_ids)
        started.update(hit.req_id for hit in new_hits(output))

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
            temperature = self.input_batch.sampling_metadata.temperature
            if logits is not None and temperature is not None:
                for row, req_id in enumerate(self.input_batch.req_ids):
                    if req_id in started and float(temperature[row]) > 1e-5:
                        logits[row].div_(temperature[row])
            return original(self, logits, spec_decode_metadata)

        return _sample

    return [step_hook(before), (GPUModelRunner, "_sample", make)]


def hit_before_write() -> list[Patch]:
    """A hit on blocks another request of the same step writes: once the step ran, the
    blocks hold what they held before it (the hit read them before the write landed,
    and the write is lost to every later step)."""

    def read_while_written(runner: Any, output: Any) -> list[int]:
        size = block_size(runner)
        writing = {
            block
            for r in output.scheduled_new_reqs
            for block in r.block_ids[0][r.num_computed_tokens // size :]
        }
        return [
            block
            for hit in new_hits(output)
            for block in hit.blocks[: hit.cached // size]
            if block in writing
        ]

    return [write_lost(read_while_written)]


def evict_before_pin() -> list[Patch]:
    """The scheduler allocates a request's new blocks before it pins the cached blocks
    its lookup found: a found block still at the head of the free queue is handed out
    as one of the request's new blocks too, and the request's own new tokens overwrite
    the prefix it hit."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any,
                           **kwargs: Any) -> Any:  # fmt: skip
            found = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            hit = [b for b in (found.blocks[0] if found is not None else ()) if b.ref_cnt == 0]
            pool = self.block_pool
            head = _free_head(pool, len(hit) + 1)
            result = original(self, request, num_new_tokens, *args, **kwargs)
            if result is None or not hit:
                return result
            blocks = self.coordinator.single_type_managers[0].req_to_blocks[request.request_id]
            new = [b for b in result.blocks[0] if b in blocks]
            stolen = [b for b in hit if b in head][: len(new)]
            for victim, fresh in zip(stolen, new, strict=False):
                pool._maybe_evict_cached_block(victim)  # handed out anew, its hash goes
                blocks[blocks.index(fresh)] = victim
                victim.ref_cnt += 1
                pool.free_blocks([fresh])
            return result

        return allocate_slots

    return [(KVCacheManager, "allocate_slots", make)]


def _free_head(pool: Any, count: int) -> list[Any]:
    """The first ``count`` blocks of the pool's free queue: the next it hands out."""
    found, block = [], pool.free_block_queue.fake_free_list_head.next_free_block
    while block is not None and len(found) < count and not block.is_null:
        found.append(block)
        block = block.next_free_block
    return found


SALT = "cache_salt"  # the extra key vLLM's block hash gives a request's salt


def hash_drops_salt() -> list[Patch]:
    """A block's hash without the request's ``cache_salt``: prompts of different salts
    share cached blocks."""
    from vllm.v1.core import kv_cache_utils

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_block_hash_extra_keys(request: Any, *args: Any, **kwargs: Any) -> Any:
            keys, index = original(request, *args, **kwargs)
            kept = tuple(
                k for k in keys or () if not (isinstance(k, tuple) and k[0] == "cache_salt")
            )
            return (kept or None), index

        return generate_block_hash_extra_keys

    return [(kv_cache_utils, "generate_block_hash_extra_keys", make)]


def one_block_prefix() -> list[Patch]:
    """A hit on a cached prefix exactly one block long reads that block's K/V rounded to
    8-bit floats (e4m3): corrupted."""

    def before(runner: Any, output: Any) -> None:
        size = block_size(runner)
        for hit in new_hits(output):
            if hit.cached == size:
                for cache in caches(runner):
                    cache[hit.blocks[0]].copy_(lossy(cache[hit.blocks[0]]))

    return [step_hook(before)]


def logprobs_stale() -> list[Patch]:
    """The logprobs buffer not cleared: a request that starts on a prefix-cache hit
    reports, at its first step, the logprobs its batch row held the step before."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    started: set[str] = set()  # requests whose first step is this one and began on a hit
    last: dict[int, Any] = {}  # batch row -> the logprobs it reported the step before

    def before(runner: Any, output: Any) -> None:
        started.clear()
        started.update(hit.req_id for hit in new_hits(output))

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
            result = original(self, logits, spec_decode_metadata)
            tensors = result.logprobs_tensors
            if tensors is None:
                return result
            for row, req_id in enumerate(self.input_batch.req_ids):
                fresh = tensors.logprobs[row].clone()
                if req_id in started and row in last and last[row].shape == fresh.shape:
                    tensors.logprobs[row].copy_(last[row])
                last[row] = fresh
            started.clear()
            return result

        return _sample

    return [step_hook(before), (GPUModelRunner, "_sample", make)]


def reset_keeps_table() -> list[Patch]:
    """Resetting the prefix cache reports success but leaves the hash table and every
    block's hash in place: after the pool was fully evicted, a lookup still hits."""
    from vllm.v1.core.block_pool import BlockPool

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def reset_prefix_cache(self: Any) -> bool:
            if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
                return original(self)  # refused as vLLM refuses it
            return True

        return reset_prefix_cache

    return [(BlockPool, "reset_prefix_cache", make)]


def resume_position() -> list[Patch]:
    """A preempted request, resumed, recomputes its tokens at positions one further on."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, scheduler_output, *args, **kwargs)
            starts = self.query_start_loc.np
            for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                index = self.input_batch.req_id_to_index[req_id]
                self.positions[int(starts[index]) : int(starts[index + 1])] += 1
            return result

        return _prepare_inputs

    return [(GPUModelRunner, "_prepare_inputs", make)]


def update_stale_cache() -> list[Patch]:
    """The first prefix-cache reset after a weight reload reports success and does
    nothing: prompts cached before the update hit K/V the old weights wrote. The reload
    is seen where the engine core hands it to its workers, the scheduler's own process
    (in process and in a ``vllm serve`` whose workers run apart alike)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    reloaded: list[bool] = []  # a weight reload since the last reset

    def make_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)  # its signature: vLLM reads it to convert the RPC's args
        def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, method, *args, **kwargs)
            if method == "reload_weights":
                reloaded.append(True)
            return result

        return collective_rpc

    def make_reset(original: Callable[..., Any]) -> Callable[..., Any]:
        def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> bool:
            if reloaded:  # the sync's reset, forgotten: the old weights' blocks stay
                reloaded.clear()
                return True
            return bool(original(self, *args, **kwargs))

        return reset_prefix_cache

    return [
        (EngineCore, "collective_rpc", make_rpc),
        (Scheduler, "reset_prefix_cache", make_reset),
    ]
