"""Constructions of a boundary state for the same prefix P (docs/design.md: constructions).

``live`` is captured from the generation that reached P; the others rebuild a state from
P's token ids: ``replay`` teacher-forces the live schedule (prompt as one chunk, then one
token at a time) and must be bit-exact with live; ``prefill`` feeds P in one chunk;
``chunked:K`` in chunks of K; ``stepwise`` one token at a time, prompt included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreplay.decode import Sampler, Segment, Trajectory, feed_each, opener_ids, run_stages
from kvreplay.errors import KvreplayError
from kvreplay.stages import StagePlan
from kvreplay.state import BoundaryState, sha256_tokens

REBUILT = ("replay", "prefill", "stepwise")


@dataclass
class Prefix:
    """P's token ids, where its prompt ends, and the stages that produced it.

    ``reached`` is False when a prefix stage that has stop strings ended without one
    (cap or EOS): the generation never reached the boundary the plan describes.
    """

    token_ids: list[int]
    prompt_len: int
    segments: list[Segment] = field(default_factory=list)
    reached: bool = True
    reason: str = ""

    @property
    def sha256(self) -> str:
        return sha256_tokens(self.token_ids)


def parse_construction(name: str) -> tuple[str, int]:
    """Split ``chunked:K`` into its kind and K; plain names have K = 0."""
    if name == "live" or name in REBUILT:
        return name, 0
    kind, _, size = name.partition(":")
    if kind == "chunked" and size.isdigit() and int(size) > 0:
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


def generated_prefix(
    prompt_ids: Sequence[int], trajectory: Trajectory, plan: StagePlan, next_opener: list[int]
) -> Prefix:
    """P as a generation of the prefix stages made it: the prompt, each stage's stream and
    the first suffix stage's opener; unreached when a stage with stops ended without one."""
    unreached = [
        s
        for s, stage in zip(trajectory.segments, plan.prefix_stages, strict=True)
        if stage.stop and not s.stop_reason.startswith("stop:")
    ]
    return Prefix(
        token_ids=[*prompt_ids, *trajectory.token_ids, *next_opener],
        prompt_len=len(prompt_ids),
        segments=trajectory.segments,
        reached=not unreached,
        reason=f"stage {unreached[0].stage!r} ended by {unreached[0].stop_reason}"
        if unreached
        else "",
    )
