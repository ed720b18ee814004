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

vLLM's CPU attention kernels each store a layer's block as K then V per KV head, packed
for their own instructions (:class:`BlockLayout`): 'vec' and 'vec16' keep the keys
channel-major (``[head_dim, block_size]``) and the values token-major; 'amx' (bf16 on a
CPU with AMX tiles) packs the keys as pairs of channels in groups of 16 tokens and the
values as pairs of tokens in groups of 16 channels. Which kernel an engine uses is its own
choice (the CPU and the precision decide); before a block is read, :meth:`BlockEngine.
check_layout` has the kernel's own cache writer (``cpu_attn_reshape_and_cache``) lay out
random K/V and refuses the engine unless kvreplay's packing gives the same bytes, so a
layout kvreplay misreads is refused rather than read.
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


@dataclass(frozen=True)
class BlockLayout:
    """How one CPU attention kernel packs a block of one KV head: K then V, each
    ``block_size * head_dim`` elements. The keys are stored as groups of ``token_group``
    tokens, in each group ``channel_pair`` channels at a time for every token; the values
    as groups of ``value_channels`` channels, in each group ``value_pair`` tokens at a
    time for every channel. None stands for the whole block (tokens) or every channel."""

    name: str
    token_group: int | None
    channel_pair: int
    value_pair: int
    value_channels: int | None

    def _key_view(self, size: int, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stored shape (token groups, channel pairs, tokens of a group, channels of
        a pair) and the order that makes it (token group, token, pair, channel)."""
        group = self.token_group or size
        return (size // group, dim // self.channel_pair, group, self.channel_pair), (0, 2, 1, 3)

    def _value_view(self, size: int, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stored shape (channel groups, token pairs, channels of a group, tokens of a
        pair) and the order that makes it (token pair, token, channel group, channel)."""
        group = self.value_channels or dim
        return (dim // group, size // self.value_pair, group, self.value_pair), (1, 3, 0, 2)

    def unpack(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's blocks (``[blocks, kv_heads, block_size, 2 * head_dim]`` as the
        kernel stores them) as K and V in the cache layout ``[1, kv_heads, tokens,
        head_dim]``."""
        count, heads, size, width = raw.shape
        dim = width // 2
        halves = raw.reshape(count, heads, 2, size * dim)

        def as_cache(half: torch.Tensor, view: tuple[tuple[int, ...], tuple[int, ...]]):
            shape, order = view
            blocks = half.reshape(count, heads, *shape).permute(0, 1, *(2 + i for i in order))
            per_block = blocks.reshape(count, heads, size, dim)
            return per_block.permute(1, 0, 2, 3).reshape(1, heads, count * size, dim)

        return (
            as_cache(halves[:, :, 0], self._key_view(size, dim)).contiguous(),
            as_cache(halves[:, :, 1], self._value_view(size, dim)).contiguous(),
        )

    def pack(self, keys: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
        """The inverse of :meth:`unpack`: K and V as the kernel stores them in blocks."""
        _, heads, tokens, dim = keys.shape
        count = tokens // block_size

        def stored(cache: torch.Tensor, view: tuple[tuple[int, ...], tuple[int, ...]]):
            shape, order = view
            storage_order = sorted(range(4), key=order.__getitem__)  # order's inverse
            logical = tuple(shape[i] for i in order)
            blocks = cache.reshape(heads, count, block_size, dim).permute(1, 0, 2, 3)
            unpacked = blocks.reshape(count, heads, *logical)
            return unpacked.permute(0, 1, *(2 + i for i in storage_order)).reshape(
                count, heads, block_size * dim
            )

        k = stored(keys, self._key_view(block_size, dim))
        v = stored(values, self._value_view(block_size, dim))
        packed = torch.stack([k, v], dim=2)
        return packed.reshape(count, heads, block_size, 2 * dim).contiguous()


def _vec(name: str) -> BlockLayout:
    """'vec' and 'vec16' (the same bytes): keys channel-major, values token-major."""
    return BlockLayout(name, token_group=None, channel_pair=1, value_pair=1, value_channels=None)


# The kernels whose packing kvreplay reads, each checked against the kernel's own writer
# before use. AMX (bf16) packs for its tiles: rows of 64 bytes, 16 lanes of bf16 pairs.
LAYOUTS = {
    "vec": _vec("vec"),
    "vec16": _vec("vec16"),
    "amx": BlockLayout("amx", token_group=16, channel_pair=2, value_pair=2, value_channels=16),
}


def layout(kernel: str | None) -> BlockLayout:
    """The layout of ``kernel``; any other kernel's blocks are refused, never guessed."""
    if kernel not in LAYOUTS:
        raise KvreplayError(
            f"kvreplay reads vLLM's CPU KV blocks as the {', '.join(LAYOUTS)} attention "
            f"kernels lay them out, but this engine uses {kernel}."
        )
    return LAYOUTS[kernel]


# What runs on the worker (``collective_rpc`` hands each the worker as its first argument).
def _layer_caches(worker: Any) -> list[Any]:
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    return [context[name] for name in runner.kv_cache_config.kv_cache_groups[0].layer_names]


def _kernels(worker: Any) -> list[str | None]:
    return [getattr(layer, "isa", None) for layer in _layer_caches(worker)]


def _written(worker: Any, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random K and V for two blocks of a layer's shape and dtype, laid out by the
    kernel's own cache writer: ``(blocks, keys, values)``, K and V as ``[tokens, kv_heads,
    head_dim]``."""
    from vllm import _custom_ops as ops

    like = _layer_caches(worker)[0].kv_cache
    _, heads, size, width = like.shape
    dim, count = width // 2, 2
    generator = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(count * size, heads, dim, generator=generator).to(like.dtype) for _ in range(2)
    )
    blocks = torch.zeros(count, heads, size, width, dtype=like.dtype)
    key_cache, value_cache = blocks.view(count, heads, size * 2, dim).chunk(2, dim=2)
    slots = torch.arange(count * size, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, kernel)
    return blocks, keys, values


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
        kernels = sorted(set(self._rpc(_kernels)), key=str)
        if len(kernels) != 1:
            raise KvreplayError(
                "kvreplay reads vLLM blocks whose layers share one attention kernel; this "
                f"engine's layers use {', '.join(map(str, kernels))}."
            )
        self.kernel = str(kernels[0])
        self.layout = layout(self.kernel)
        self.check_layout()
        self.num_layers = len(groups[0].layer_names)
        self.vocab_size = served.engine.llm_engine.model_config.get_vocab_size()

    def check_layout(self) -> None:
        """Refuse the engine unless kvreplay packs K/V exactly as its kernel's own cache
        writer does (random K/V written both ways, compared bit for bit), so that a
        layout kvreplay misreads (another vLLM, another kernel) is never read."""
        blocks, keys, values = self._rpc(_written, self.kernel)
        as_cache = [t.permute(1, 0, 2).unsqueeze(0) for t in (keys, values)]
        size = blocks.shape[2]
        read = self.layout.unpack(blocks)
        if not (
            bit_equal(self.layout.pack(*as_cache, size), blocks)
            and all(bit_equal(a, b) for a, b in zip(read, as_cache, strict=True))
        ):
            raise KvreplayError(
                f"vLLM's {self.kernel!r} attention kernel lays out its KV blocks "
                "otherwise than kvreplay reads them (another vLLM version?), so their K/V "
                "cannot be read."
            )

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
        layers = [self.layout.unpack(raw) for raw in self._rpc(_read_blocks, blocks)]
        state = BlockState(layers, None, list(ids), construction, self)
        state.logits = self.boundary_logits(state)
        return state

    def install(self, state: BlockState) -> list[int]:
        """Reset the cache, make P's blocks again and write the state's K/V over them;
        return the blocks, which a request for P then hits."""
        self.reset()
        self.prefill(state.token_ids[: state.covered + 1])
        blocks = self.blocks(state.token_ids, state.covered)
        packed = [self.layout.pack(keys, values, self.block_size) for keys, values in state.cache]
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
            bit_equal(raw, self.layout.pack(keys, values, self.block_size))
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
        return [f"vllm:{self.engine.layout.name}:{self.engine.block_size}"] * len(self.cache)

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
