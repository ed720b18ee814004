"""Continuation: decode stage by stage from a state, greedily or with seeded sampling.

Every token after the prompt is fed one at a time (the live schedule). A stage's opener
is teacher-forced token by token when the stage begins; a stop string, an EOS token or
the stage's cap ends it. The last token of the final stage is never fed: nothing reads
the state after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvreplay.errors import KvreplayError
from kvreplay.stages import Stage, StagePlan, StopDetector
from kvreplay.state import BoundaryState
from kvreplay.trajectory import Segment, Trajectory, step_digest


@dataclass(frozen=True)
class Sampler:
    """Greedy when ``temperature`` is 0; otherwise seeded temperature/top-p sampling.

    Each continuation draws from its own generator seeded with ``seed``, so two arms (or
    a state and its replica) see the same random stream and differ only by their state.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse NaN and infinities too (a comparison alone lets NaN through)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0 and 0 < self.top_p <= 1):
            raise KvreplayError("Sampling needs a finite temperature >= 0 and 0 < top_p <= 1.")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise KvreplayError("The sampling seed must be an integer in [0, 2**63).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        return None if self.greedy else torch.Generator().manual_seed(self.seed)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator).item())


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the step was to a different argmax."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def opener_ids(tokenizer: Any, stage: Stage) -> list[int]:
    """Token ids of a stage's opener; an opener that tokenizes to nothing is an error."""
    if not stage.opener:
        return []
    ids = tokenizer.encode(stage.opener, add_special_tokens=False)
    if not ids:
        raise KvreplayError(f"The opener of stage {stage.name!r} tokenizes to nothing.")
    return list(ids)


def eos_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """EOS ids from the tokenizer and the model's generation config (either may name
    one id, several or none)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return frozenset(ids)


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
