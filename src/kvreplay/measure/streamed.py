"""Statistics of data too large to hold, computed as it streams by with bounded state, and
equal to what the whole data would give (design: mismatch, any size).

- :class:`Sums`: sums of float64 values that arrive in blocks, each block summed by
  numpy and the blocks' sums by :func:`math.fsum`: the same data read again gives the
  same sums bit for bit.
- :class:`Spill`: values written to a temporary file as they pass, whose order
  statistics are then selected exactly (in memory when there are few, else by a radix
  select over the file that holds no more than a bucket at a time), and quantiles read
  as :func:`numpy.quantile`'s default method reads them.
- :func:`mean_interval`: the 95% interval of a per-token mean over resampled sequences:
  the paper's percentile bootstrap up to :data:`BOOTSTRAP_SEQUENCES` sequences, above
  that the normal interval of a ratio estimator (its 20,000 resamples would draw more
  indices than the data has tokens), which agrees with the bootstrap there.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvreplay.measure.stats import row_bootstrap_ci


class Sums:
    """``groups`` sums of float64 values that arrive in blocks: each block's sum per group
    (numpy's pairwise sum), and the blocks' sums added up with :func:`math.fsum`. The
    blocks are cut where the data says (a reader's block of whole sequences), so the
    same data read again gives the same sums, bit for bit."""

    def __init__(self, groups: int):
        self.partials: list[list[float]] = [[] for _ in range(groups)]

    def add(self, block: np.ndarray) -> None:
        """One block: a (groups, n) array, row g added to the sum g."""
        for partials, total in zip(self.partials, np.sum(block, axis=1).tolist(), strict=True):
            partials.append(total)

    def add_totals(self, totals: Sequence[float]) -> None:
        """One block's sums, one per group, summed already (a bincount's)."""
        for partials, total in zip(self.partials, totals, strict=True):
            partials.append(float(total))

    def value(self, group: int) -> float:
        return math.fsum(self.partials[group])


IN_MEMORY = 1 << 20  # values whose order statistics are selected in memory (8 MiB)
CHUNK = 1 << 18  # values read back at a time: a radix pass holds a few arrays this long
_BITS = 16  # key bits a radix pass decides


class Spill:
    """Float64 values written to a temporary file as they stream by (the file is gone
    when the spill is closed or collected), for their exact order statistics."""

    def __init__(self, in_memory: int = IN_MEMORY):
        self.file = tempfile.TemporaryFile()
        self.count = 0
        self.in_memory = in_memory

    def add(self, values: np.ndarray) -> None:
        values.astype("<f8").tofile(self.file)
        self.count += int(values.size)

    def close(self) -> None:
        self.file.close()

    def _chunks(self) -> Iterator[np.ndarray]:
        self.file.flush()
        self.file.seek(0)
        while True:
            chunk = np.fromfile(self.file, dtype="<f8", count=CHUNK)
            if not chunk.size:
                return
            yield chunk

    def order_statistics(self, ranks: Sequence[int]) -> dict[int, float]:
        """The values at 0-based ``ranks`` in ascending order (ties in any order: equal
        floats, or 0 and -0, which compare equal)."""
        wanted = sorted(set(ranks))
        if self.count <= self.in_memory:
            values = np.concatenate([np.zeros(0), *self._chunks()])
            chosen = np.partition(values, wanted) if wanted else values
            return {rank: float(chosen[rank]) for rank in wanted}
        return {rank: _from_key(key) for rank, key in self._radix(wanted).items()}

    def _radix(self, ranks: list[int]) -> dict[int, int]:
        """Each rank's sortable key, 16 bits a pass: a pass counts the keys under each
        rank's prefix by their next 16 bits and narrows the prefix to the bucket that
        holds the rank (the ranks below the bucket are carried as an offset)."""
        prefix = {rank: 0 for rank in ranks}
        below = {rank: 0 for rank in ranks}
        for known in range(0, 64, _BITS):
            shift = 64 - known - _BITS
            counts = {p: np.zeros(1 << _BITS, dtype=np.int64) for p in set(prefix.values())}
            for chunk in self._chunks():
                keys = _keys(chunk)
                heads = keys >> np.uint64(64 - known) if known else np.zeros_like(keys)
                buckets = ((keys >> np.uint64(shift)) & np.uint64((1 << _BITS) - 1)).astype(
                    np.int64
                )
                for p, count in counts.items():
                    count += np.bincount(buckets[heads == np.uint64(p)], minlength=1 << _BITS)
            for rank in ranks:
                cumulative = np.cumsum(counts[prefix[rank]])
                bucket = int(np.searchsorted(cumulative, rank - below[rank], side="right"))
                below[rank] += int(cumulative[bucket - 1]) if bucket else 0
                prefix[rank] = (prefix[rank] << _BITS) | bucket
        return prefix


def _keys(values: np.ndarray) -> np.ndarray:
    """Unsigned keys in the order of the floats (negative ones bit-flipped)."""
    bits = values.view(np.uint64)
    negative = (bits >> np.uint64(63)).astype(bool)
    return np.where(negative, ~bits, bits | np.uint64(1 << 63))


def _from_key(key: int) -> float:
    bits = key ^ (1 << 63) if key >> 63 else ~key & ((1 << 64) - 1)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def quantiles(
    spill: Spill, qs: Sequence[float], transform: Callable[[float], float] = float
) -> list[float]:
    """The ``qs`` quantiles of the spilled values (of ``transform`` of them, a
    non-decreasing function such as :func:`math.exp`), as :func:`numpy.quantile`'s default
    (linear) method computes them from the two order statistics around each."""
    n = spill.count
    places = []
    for q in qs:
        virtual = (n - 1) * q  # numpy's virtual index of the linear method
        previous = math.floor(virtual)
        if virtual >= n - 1:  # at or past the last: the largest value
            places.append((n - 1, n - 1, virtual - previous))
        else:
            places.append((previous, previous + 1, virtual - previous))
    found = spill.order_statistics([r for p in places for r in p[:2]])
    return [_lerp(transform(found[a]), transform(found[b]), gamma) for a, b, gamma in places]


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's linear interpolation between two neighbours (its ``_lerp``)."""
    difference = b - a
    return b - difference * (1 - t) if t >= 0.5 else a + difference * t


BOOTSTRAP_SEQUENCES = 2_000
"""Up to this many sequences an interval is the paper's bootstrap (20,000 resamples of
whole sequences); above it, the normal interval of the ratio estimator."""


@dataclass(frozen=True)
class Interval:
    """A 95% interval, and how it was made (``bootstrap`` or ``normal``)."""

    low: float
    high: float
    method: str


def mean_interval(sums: np.ndarray, tokens: np.ndarray, stream: int) -> Interval | None:
    """95% interval of the per-token mean sum(sums) / sum(tokens) over resamples of whole
    sequences (``sums``, ``tokens``: one entry per sequence; ``stream`` fixes the draws,
    so terms resampled with one stream are paired); None without a sequence."""
    n = int(sums.size)
    if n == 0:
        return None
    if n <= BOOTSTRAP_SEQUENCES:
        found = row_bootstrap_ci(
            lambda index: sums[index].sum(axis=1) / tokens[index].sum(axis=1), n, stream
        )
        return None if found is None else Interval(found.low, found.high, "bootstrap")
    total = float(tokens.sum())
    ratio = float(sums.sum()) / total
    residual = sums - ratio * tokens
    half = 1.959963984540054 * math.sqrt(n / (n - 1) * float(residual @ residual)) / total
    return Interval(ratio - half, ratio + half, "normal")
