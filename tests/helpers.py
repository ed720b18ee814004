"""Plans, prompts and small helpers shared by the core-engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvreplay import BoundaryState, LoadedModel, Prefix, StagePlan, encode_prompt, live
from kvreplay.stages import Stage

# Long enough on the tiny models for bf16 prefill to drift from live (24 decoded tokens
# in the prefix) and for that drift to flip a suffix token on some prompt of each arch.
PLAN = StagePlan(
    name="test",
    stages=(
        Stage("think", max_new_tokens=24),
        Stage("trace", max_new_tokens=48),
        Stage("answer", max_new_tokens=4, opener="\nA:"),
    ),
)
# A short plan for tests that only need some boundary state.
SHORT = StagePlan(
    name="test-short",
    stages=(
        Stage("think", max_new_tokens=10),
        Stage("trace", max_new_tokens=8),
        Stage("answer", max_new_tokens=3, opener="\nA:"),
    ),
)
DEFAULT_THREADS = torch.get_num_threads()  # read at collection, before conftest sets 1
INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
PROMPTS = (
    "Compute 3 + 4 * 5 step by step.",
    "A shop has 17 apples. It sells 5 apples. How many are left?",
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 3,
)


def reach(
    lm: LoadedModel, plan: StagePlan = SHORT, prompt: str = PROMPTS[0]
) -> tuple[BoundaryState, Prefix]:
    """The live boundary state and prefix of ``prompt`` under ``plan``."""
    return live(lm, encode_prompt(lm.tokenizer, prompt), plan)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (so -0.0 != 0.0 and NaN == NaN bitwise)."""
    return tensor.detach().contiguous().view(INT_OF_SIZE[tensor.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def cache_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Every K and V tensor bit-equal and every layer's length equal."""
    return a.layer_lengths() == b.layer_lengths() and all(
        bit_equal(x, y)
        for pa, pb in zip(a.layer_tensors(), b.layer_tensors(), strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def state_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Same prefix, bit-equal cache and bit-equal boundary logits."""
    assert a.logits is not None and b.logits is not None
    return a.token_ids == b.token_ids and cache_equal(a, b) and bit_equal(a.logits, b.logits)


@contextmanager
def default_threads() -> Iterator[None]:
    """Run with torch's default intra-op thread count, as a user's run would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
