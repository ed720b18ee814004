"""A decoded continuation as rows record it: each stage's forced opener, decoded tokens,
why it ended and its top-1/top-2 margins. Plain data, no torch: the typed rows, the CSVs
and the analysis read it without loading a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Segment:
    """One stage of a trajectory: forced opener ids, decoded ids, why it ended, margins."""

    stage: str
    opener_ids: list[int]
    token_ids: list[int]
    stop_reason: str
    margins: list[float] = field(default_factory=list)

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "segments": [
                {
                    "stage": s.stage,
                    "opener_ids": s.opener_ids,
                    "token_ids": s.token_ids,
                    "stop_reason": s.stop_reason,
                    "margins": [round(m, 6) for m in s.margins],
                }
                for s in self.segments
            ]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls([Segment(**s) for s in data["segments"]])
