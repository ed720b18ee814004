"""Block K/V (design: block K/V): the K and V that an in-process vLLM engine holds in its
cached blocks of a prefix P, read and written through the engine's own interfaces, as
boundary states.

The engine core runs in this process, so the scheduler's KV-cache manager says which
blocks a request for P would hit (``get_computed_blocks`` over the block hashes vLLM
itself computes for P's tokens), and ``LLM.collective_rpc`` runs a function on the worker
that holds each layer's KV tensor. Only full blocks are cached: a state covers P's first
``covered`` tokens (a multiple of the block size); the rest of P, its partial last block
at least, is recomputed by every request that hits those blocks.

A :class:`BlockState` holds a copy of the blocks, layer by layer, K and V apart, in the
cache layout ``[1, kv_heads, covered, head_dim]``, and its boundary logits: the engine's
raw log-probabilities (vLLM reports no logits) of the first step of a request that hits
exactly these blocks. Every state goes back into the engine the same way
(:meth:`BlockEngine.install`): the prefix cache is reset, P's blocks are made again by a
prefill of their tokens, and the state's K/V are written over them; a request for P then
hits them, and :meth:`BlockEngine.holds` checks afterwards that it read exactly those
blocks. Two states of one P therefore continue under one schedule and differ only in
what their blocks hold.

vLLM's CPU attention kernel for this case ('vec') stores each block of a layer as K then
V per KV head, the keys channel-major (``[head_dim, block_size]``) and the values
token-major (``[block_size, head_dim]``); other kernels' packings (AMX in bf16) are
refused rather than guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from kvreplay.core.errors import KvreplayError
from kvreplay.model.state import BoundaryState, Component, bit_equal

FORCED = "kvreplay_forced"  # the SamplingParams.extra_args key of a forced request's tokens
KERNEL = "vec"  # the CPU attention kernel whose block layout kvreplay reads


class ForcedTokens(AdapterLogitsProcessor):
    """Teacher forcing through the engine's decode path: a request whose ``extra_args``
    name tokens samples exactly those, one per decode step, so their K/V are computed as
    a generation that chose them would compute them. Other requests are untouched."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        forced = (params.extra_args or {}).get(FORCED)
        if not forced:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(forced):
                chosen = logits[forced[step]].clone()
                logits.fill_(-math.inf)
                logits[forced[step]] = chosen
            return logits

        return force


def unpack(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's blocks (``[blocks, kv_heads, block_size, 2 * head_dim]`` as the
    kernel stores them) as K and V in the cache layout ``[1, kv_heads, tokens, head_dim]``."""
    count, heads, size, width = raw.shape
    dim = width // 2
    halves = raw.reshape(count, heads, 2, size * dim)
    keys = halves[:, :, 0].reshape(count, heads, dim, size).transpose(2, 3)
    values = halves[:, :, 1].reshape(count, heads, size, dim)

    def as_cache(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.permute(1, 0, 2, 3).reshape(1, heads, count * size, dim).contiguous()

    return as_cache(keys), as_cache(values)


def pack(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The inverse of :func:`unpack`: K and V as the kernel stores them in blocks."""
    _, heads, tokens, dim = keys.shape
    count = tokens // block_size

    def per_block(cache: torch.Tensor) -> torch.Tensor:
        return cache.reshape(heads, count, block_size, dim).permute(1, 0, 2, 3)

    k = per_block(keys).transpose(2, 3).reshape(count, heads, block_size * dim)
    v = per_block(values).reshape(count, heads, block_size * dim)
    return torch.stack([k, v], dim=2).reshape(count, heads, block_size, 2 * dim).contiguous()


# What runs on the worker (``collective_rpc`` hands each the worker as its first argument).
def _layer_caches(worker: Any) -> list[Any]:
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    return [context[name] for name in runner.kv_cache_config.kv_cache_groups[0].layer_names]


def _kernels(worker: Any) -> list[str | None]:
    return [getattr(layer, "isa", None) for layer in _layer_caches(worker)]


def _read_blocks(worker: Any, ids: list[int]) -> list[torch.Tensor]:
    return [layer.kv_cache[ids].clone() for layer in _layer_caches(worker)]


def _write_blocks(worker: Any, ids: list[int], blocks: list[torch.Tensor]) -> None:
    for layer, block in zip(_layer_caches(worker), blocks, strict=True):
        layer.kv_cache[ids] = block


class BlockEngine:
    """An in-process vLLM engine (``VllmServed``) seen through its cached blocks: finds
    P's blocks as the scheduler does, reads and writes them on the worker, builds the
    requests the engine constructions need, and probes a state's boundary logits."""

    def __init__(self, served: Any, block_size: int):
        self.served, self.block_size = served, block_size
        core = getattr(served.engine.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise KvreplayError(
                "kvreplay reads vLLM's cached blocks only with the engine core in this "
                "process; unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0."
            )
        self._manager = core.scheduler.kv_cache_manager
        self._hasher = core.request_block_hasher
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise KvreplayError(
                "kvreplay reads vLLM blocks of models whose layers share one full-attention "
                f"KV-cache group; this model has {len(groups)} groups."
            )
        kernels = set(self._rpc(_kernels))
        if kernels != {KERNEL}:
            raise KvreplayError(
                f"kvreplay reads vLLM's CPU KV blocks as the {KERNEL!r} attention kernel lays "
                f"them out, but this engine uses {', '.join(map(str, sorted(kernels, key=str)))}."
            )
        self.num_layers = len(groups[0].layer_names)
        self.vocab_size = served.engine.llm_engine.model_config.get_vocab_size()

    def _rpc(self, function: Any, *args: Any) -> Any:
        return self.served.engine.collective_rpc(function, args=args)[0]

    def _generate(self, ids: list[int], params: SamplingParams) -> Any:
        return self.served.engine.generate(
            [{"prompt_token_ids": list(ids)}], params, use_tqdm=False
        )[0]

    def covered(self, computed: int) -> int:
        """The tokens of P in cached blocks when ``computed`` of them were computed."""
        return computed // self.block_size * self.block_size

    def coverage(self, state: BoundaryState) -> dict[str, int]:
        """What a row records of its states' blocks: the block size, the tokens of P
        they cover (all the K/V compared) and the tail every hit recomputes."""
        cached = max(state.layer_lengths(), default=0)
        return {
            "block_size": self.block_size,
            "cached_tokens": cached,
            "tail_tokens": state.position - cached,
        }

    def reset(self) -> None:
        self.served.reset_cache()

    def prefill(self, ids: list[int]) -> None:
        """One request over ``ids``: a one-shot prefill, which caches their full blocks."""
        self._generate(ids, SamplingParams(max_tokens=1, detokenize=False))

    def force(self, context: list[int], tokens: list[int]) -> None:
        """One request from ``context`` that decodes exactly ``tokens``, one per step."""
        params = SamplingParams(
            temperature=0,
            max_tokens=len(tokens),
            ignore_eos=True,
            detokenize=False,
            extra_args={FORCED: list(tokens)},
        )
        if list(self._generate(context, params).outputs[0].token_ids) != list(tokens):
            raise KvreplayError("vLLM did not decode the tokens kvreplay forced.")

    def blocks(self, ids: list[int], covered: int) -> list[int]:
        """The cached blocks of ``ids``'s first ``covered`` tokens, found as the scheduler
        finds a new request's hit: through the block hashes vLLM computes for them."""
        request = Request(
            "kvreplay-blocks",
            list(ids[: covered + 1]),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self._hasher,
        )
        found, tokens = self._manager.get_computed_blocks(request)[:2]
        if tokens != covered:
            raise KvreplayError(
                f"vLLM holds cached blocks for {tokens} of the {covered} tokens of P that "
                "they should cover (a prefix-cache reset or eviction dropped the rest), so "
                "their K/V cannot be read."
            )
        return list(found.get_block_ids()[0])

    def read(self, ids: list[int], covered: int, construction: str) -> BlockState:
        """P's cached blocks as a state, with the boundary logits a hit on them gives."""
        blocks = self.blocks(ids, covered)
        layers = [unpack(raw) for raw in self._rpc(_read_blocks, blocks)]
        state = BlockState(layers, None, list(ids), construction, self)
        state.logits = self.boundary_logits(state)
        return state

    def install(self, state: BlockState) -> list[int]:
        """Reset the cache, make P's blocks again and write the state's K/V over them;
        return the blocks, which a request for P then hits."""
        self.reset()
        self.prefill(state.token_ids[: state.covered + 1])
        blocks = self.blocks(state.token_ids, state.covered)
        packed = [pack(keys, values, self.block_size) for keys, values in state.cache]
        self._rpc(_write_blocks, blocks, packed)
        return blocks

    def holds(self, state: BlockState, blocks: list[int]) -> bool:
        """The hit guard, after a request for P: P's cached blocks are still ``blocks``
        and still hold the state's K/V bit for bit, so the request read exactly them."""
        try:
            if self.blocks(state.token_ids, state.covered) != blocks:
                return False
        except KvreplayError:
            return False
        raws = self._rpc(_read_blocks, blocks)
        return all(
            bit_equal(raw, pack(keys, values, self.block_size))
            for raw, (keys, values) in zip(raws, state.cache, strict=True)
        )

    def boundary_logits(self, state: BlockState) -> torch.Tensor:
        """The raw log-probabilities of the first step of a request for P that hits the
        state's blocks (every token's: the engine starts with ``max_logprobs=-1``)."""
        blocks = self.install(state)
        params = SamplingParams(
            temperature=0, max_tokens=1, logprobs=-1, ignore_eos=True, detokenize=False
        )
        output = self._generate(state.token_ids, params)
        if output.num_cached_tokens != state.covered or not self.holds(state, blocks):
            raise KvreplayError("vLLM's request for P did not read the blocks kvreplay wrote.")
        step = output.outputs[0].logprobs[0]
        logits = torch.full((self.vocab_size,), -math.inf, dtype=torch.float32)
        tokens = torch.tensor(list(step), dtype=torch.long)
        logits[tokens] = torch.tensor([step[int(t)].logprob for t in tokens], dtype=torch.float32)
        return logits


@dataclass
class BlockState(BoundaryState):
    """A boundary state held as a copy of P's cached blocks in a vLLM engine (``cache``:
    each layer's K and V over the covered tokens), which goes back into the engine to
    be continued or probed (:class:`BlockEngine`)."""

    cache: list[tuple[torch.Tensor, torch.Tensor]]
    engine: BlockEngine

    @property
    def covered(self) -> int:
        """The tokens of P the blocks cover; the rest is recomputed by every hit."""
        return int(self.cache[0][0].shape[2]) if self.cache else 0

    def advance(self, model: Any, ids: Any) -> None:
        raise KvreplayError("A vLLM block state advances only by the engine's own requests.")

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.cache

    def layer_lengths(self) -> list[int]:
        return [int(keys.shape[2]) for keys, _ in self.cache]

    def layer_kinds(self) -> list[str]:
        return [f"vllm:{KERNEL}:{self.engine.block_size}"] * len(self.cache)

    def storages(self) -> set[int]:
        """As a state's, less empty tensors (a P shorter than a block caches none)."""
        tensors = [t for pair in self.cache for t in pair if t.numel()]
        if self.logits is not None:
            tensors.append(self.logits)
        return {t.untyped_storage().data_ptr() for t in tensors}

    def copy(self) -> BlockState:
        return BlockState(
            [(keys.clone(), values.clone()) for keys, values in self.cache],
            None if self.logits is None else self.logits.clone(),
            list(self.token_ids),
            self.construction,
            self.engine,
        )

    def take_layers(self, donor: BoundaryState, layers: list[int], component: Component) -> None:
        """Take the donor's K and/or V of ``layers``; the boundary logits are then the
        engine's over the new blocks: a hit recomputes P's tail from what they hold."""
        for index in layers:
            (keys, values), (donor_keys, donor_values) = (
                self.cache[index],
                donor.layer_tensors()[index],
            )
            self.cache[index] = (
                donor_keys.clone() if component in ("kv", "k") else keys,
                donor_values.clone() if component in ("kv", "v") else values,
            )
        self.logits = self.engine.boundary_logits(self)


@dataclass
class VllmModel:
    """A model in an in-process vLLM engine whose boundary states are the engine's
    cached blocks: what the K/V experiments take as their model on the vllm backend
    (the interface of :class:`~kvreplay.backends.hf.loading.LoadedModel` they use, and
    ``engine``)."""

    engine: BlockEngine
    tokenizer: Any
    spec: str
    dtype_name: str
    identity: Any
    context_length: int
    device: str = "cpu"

    @property
    def num_layers(self) -> int:
        return self.engine.num_layers
