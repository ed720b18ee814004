"""The paper's rate object (count, n, rate and a clipped Wilson interval) and the plain
numbers every claims section counts, with how the summary and the report write them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvreplay.measure.stats import wilson_interval

Json = dict[str, Any]


@dataclass(frozen=True)
class Rate:
    """The paper's rate object: count, n, rate and a clipped Wilson interval."""

    count: int
    n: int
    rate: float
    wilson_95_ci: tuple[float, float]

    @classmethod
    def of(cls, hits: int, n: int, z: float) -> Rate:
        return cls(hits, n, hits / n if n else 0.0, wilson_interval(hits, n, z))

    @property
    def text(self) -> str:
        """count/n: the exact numbers behind a percentage."""
        return fraction(self.count, self.n)

    @property
    def percent(self) -> str:
        """A percentage with its Wilson interval."""
        low, high = self.wilson_95_ci
        return f"{100 * self.rate:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def count(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


def median(values: np.ndarray) -> float:
    return float(np.median(values))


def fraction(hits: int, n: int) -> str:
    return f"{hits}/{n}"


def interval(low: float, high: float) -> str:
    """A signed interval in percentage points."""
    return f"[{low:+.1f}, {high:+.1f}]"
