"""Continuation: decode stage by stage from a state, greedily or with seeded sampling.

Every token after the prompt is fed one at a time (the live schedule). A stage's opener
is teacher-forced token by token when the stage begins; a stop string, an EOS token or
the stage's cap ends it. The last token of the final stage is never fed: nothing reads
the state after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import Stage, StagePlan, StopDetector, eos_ids, opener_ids
from kvreplay.core.trajectory import Segment, Trajectory, step_digest
from kvreplay.model.state import BoundaryState


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the step was to a different argmax."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def feed_each(state: BoundaryState, model: Any, ids: Sequence[int]) -> None:
    """Teacher-force ``ids`` one token at a time (the live schedule)."""
    for token in ids:
        state.advance(model, [token])


def run_stage(
    lm: Any,
    state: BoundaryState,
    stage: Stage,
    forced: list[int],
    sampler: Sampler,
    generator: torch.Generator | None,
    feed_last: bool,
) -> Segment:
    """Decode one stage from ``state`` (whose opener ``forced`` is already fed)."""
    detector = StopDetector(
        lm.tokenizer, stage.stop, eos_ids(lm.tokenizer, lm.model.generation_config)
    )
    tokens: list[int] = []
    margins: list[float] = []
    digests: list[str] = []
    reason = "cap"
    while len(tokens) < stage.max_new_tokens:
        assert state.logits is not None
        token = sampler.pick(state.logits, generator)
        margins.append(top2_margin(state.logits))
        digests.append(step_digest(state.logits_fingerprint()))
        tokens.append(token)
        hit = detector.hit(tokens)
        done = hit is not None or len(tokens) == stage.max_new_tokens
        if not done or feed_last:
            state.advance(lm.model, [token])
        if hit is not None:
            reason = hit
            break
    return Segment(stage.name, forced, tokens, reason, margins, digests)


def run_stages(
    lm: Any,
    state: BoundaryState,
    stages: Sequence[Stage],
    sampler: Sampler,
    first_opener_fed: bool,
    feed_last: bool,
) -> Trajectory:
    """Run ``stages`` in order; the final stage's last token is fed only if ``feed_last``."""
    generator = sampler.generator()
    segments = []
    for index, stage in enumerate(stages):
        forced = opener_ids(lm.tokenizer, stage)
        if not (index == 0 and first_opener_fed):
            feed_each(state, lm.model, forced)
        last = index == len(stages) - 1
        segments.append(
            run_stage(lm, state, stage, forced, sampler, generator, feed_last or not last)
        )
    return Trajectory(segments)


def continue_from(
    lm: Any, state: BoundaryState, plan: StagePlan, sampler: Sampler | None = None
) -> Trajectory:
    """Continue a boundary state through the plan's suffix stages.

    The state is consumed (it advances); continue a clone to keep the original.
    """
    return run_stages(
        lm, state, plan.suffix_stages, sampler or Sampler(), first_opener_fed=True, feed_last=False
    )
