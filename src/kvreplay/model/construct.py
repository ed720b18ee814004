"""Constructions of a boundary state for the same prefix P (docs/design.md: constructions).

``live`` is captured from the generation that reached P; the others rebuild a state from
P's token ids: ``replay`` teacher-forces the live schedule (prompt as one chunk, then one
token at a time) and must be bit-exact with live; ``prefill`` feeds P in one chunk;
``chunked:K`` in chunks of K; ``stepwise`` one token at a time, prompt included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import StagePlan, opener_ids
from kvreplay.core.trajectory import Prefix, generated_prefix
from kvreplay.model.decode import feed_each, run_stages
from kvreplay.model.state import BoundaryState

REBUILT = ("replay", "prefill", "stepwise")


def parse_construction(name: str) -> tuple[str, int]:
    """Split ``chunked:K`` into its kind and K; plain names have K = 0."""
    if name == "live" or name in REBUILT:
        return name, 0
    kind, _, size = name.partition(":")
    if kind == "chunked" and size.isascii() and size.isdigit() and size[0] != "0":
        return kind, int(size)
    raise KvreplayError(
        f"Unknown construction {name!r}; choose live, replay, prefill, stepwise or chunked:K."
    )


def check_fits(lm: Any, prompt_len: int, plan: StagePlan) -> None:
    """Refuse before any model work if the prompt plus every stage cannot fit the context."""
    budget = prompt_len + sum(
        s.max_new_tokens + len(opener_ids(lm.tokenizer, s)) for s in plan.stages
    )
    if lm.context_length and budget > lm.context_length:
        raise KvreplayError(
            f"The prompt ({prompt_len} tokens) plus the plan's stages ({budget - prompt_len} "
            f"tokens) exceed the model's context window of {lm.context_length} tokens."
        )


def build(lm: Any, prefix: Prefix, construction: str) -> BoundaryState:
    """Rebuild a boundary state over ``prefix`` by a non-live construction."""
    kind, size = parse_construction(construction)
    if kind == "live":
        raise KvreplayError("A live state is captured from a generation, not rebuilt; use live().")
    ids = prefix.token_ids
    if lm.context_length and len(ids) > lm.context_length:
        raise KvreplayError(
            f"The prefix ({len(ids)} tokens) exceeds the model's context window of "
            f"{lm.context_length} tokens."
        )
    state = lm.empty_state(construction)
    chunks: list[Sequence[int]]
    if kind == "prefill":
        chunks = [ids]
    elif kind == "chunked":
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    elif kind == "stepwise":
        chunks = [[t] for t in ids]
    else:  # replay: the live schedule
        chunks = [ids[: prefix.prompt_len]] + [[t] for t in ids[prefix.prompt_len :]]
    for chunk in chunks:
        state.advance(lm.model, chunk)
    return state


def live(
    lm: Any, prompt_ids: Sequence[int], plan: StagePlan, sampler: Sampler | None = None
) -> tuple[BoundaryState, Prefix]:
    """Generate from the prompt to the boundary and keep the decoder's own state.

    The returned state is the generation's: continuing it with ``continue_from`` is the
    live continuation, not a recomputation.
    """
    check_fits(lm, len(prompt_ids), plan)
    state = lm.empty_state("live")
    state.advance(lm.model, list(prompt_ids))
    trajectory = run_stages(
        lm, state, plan.prefix_stages, sampler or Sampler(), first_opener_fed=False, feed_last=True
    )
    next_opener = opener_ids(lm.tokenizer, plan.suffix_stages[0])
    feed_each(state, lm.model, next_opener)
    prefix = generated_prefix(prompt_ids, trajectory, plan, next_opener)
    return state, prefix
