"""A decoded continuation as rows record it: each stage's forced opener, decoded tokens,
why it ended, its top-1/top-2 margins and each decoded step's numerics digest; and the
prefix P a generation reached. Plain data, no torch: the typed rows, the CSVs, the
analysis and the served backends read it without loading a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.stages import StagePlan

DIGEST_CHARS = 16
"""Hex characters a step digest keeps of its SHA-256 (64 bits: ample to tell two arms'
numerics apart, at a sixth of the ledger space of a whole digest)."""


def step_digest(fingerprint: str) -> str:
    """A decoded step's digest: the head of the fingerprint of what the backend computed
    there (the logits where it has them, else its top-k logprobs)."""
    return fingerprint[:DIGEST_CHARS]


@dataclass
class Segment:
    """One stage of a trajectory: forced opener ids, decoded ids, why it ended, margins,
    and per decoded step a digest of what the backend computed there (design: level):
    two arms whose digests agree at a step had bit-equal numerics there. Rows written
    before digests were recorded have none (an empty list)."""

    stage: str
    opener_ids: list[int]
    token_ids: list[int]
    stop_reason: str
    margins: list[float] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    @property
    def stream(self) -> list[int]:
        return self.opener_ids + self.token_ids


@dataclass
class Trajectory:
    """Segments of consecutive stages, in order."""

    segments: list[Segment]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.stream]

    def stage(self, name: str) -> Segment | None:
        return next((s for s in self.segments if s.stage == name), None)

    @property
    def digests(self) -> list[str] | None:
        """Every decoded step's digest, in order; None when a stage decoded tokens
        without recording them (a row written before digests were)."""
        if any(len(s.digests) != len(s.token_ids) for s in self.segments):
            return None
        return [d for s in self.segments for d in s.digests]

    def to_dict(self, digests: bool = True) -> dict[str, Any]:
        """As rows store it; ``digests`` False leaves them out (a prefix's own stages,
        which nothing compares)."""
        return {
            "segments": [
                {
                    "stage": s.stage,
                    "opener_ids": s.opener_ids,
                    "token_ids": s.token_ids,
                    "stop_reason": s.stop_reason,
                    "margins": [round(m, 6) for m in s.margins],
                    **({"digests": s.digests} if digests and s.digests else {}),
                }
                for s in self.segments
            ]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls([Segment(**s) for s in data["segments"]])


@dataclass(frozen=True)
class NumericDivergence:
    """Where two continuations' numerics first part (design: numeric divergence index):
    ``index`` is a suffix token index (0: the boundary logits; forced opener tokens
    have no step) or None when every step agrees; ``recorded`` is False when either
    continuation lacks step digests, so nothing can be said at the bits level."""

    recorded: bool
    index: int | None = None

    @property
    def parts(self) -> bool:
        return self.recorded and self.index is not None


def numeric_divergence(left: Trajectory, right: Trajectory) -> NumericDivergence:
    """The first suffix token whose step digests differ, or where the streams part
    (a different token, or one stream ending) before any digest does."""
    if left.digests is None or right.digests is None:
        return NumericDivergence(recorded=False)
    a, b = _steps(left), _steps(right)
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return NumericDivergence(True, index)
    return NumericDivergence(True, None if len(a) == len(b) else min(len(a), len(b)))


def _steps(trajectory: Trajectory) -> list[tuple[int, str | None]]:
    """Each suffix token with its step's digest (None for a forced opener token)."""
    steps: list[tuple[int, str | None]] = []
    for s in trajectory.segments:
        steps += [(t, None) for t in s.opener_ids]
        steps += list(zip(s.token_ids, s.digests, strict=True))
    return steps


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
