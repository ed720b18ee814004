"""Interval estimates and tests behind the stage-replay claims (the paper's method).

Every function here is pure and deterministic so that a claims file can be
regenerated bit-for-bit from its ledgers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import ArrayLike

BOOTSTRAP_SEED = 20260728
BOOTSTRAP_REPLICATES = 20_000
BOOTSTRAP_BLOCK = 1_000
# The most row indices one resample matrix holds (2 MiB of int64): a block of 1,000
# resamples of a million rows would take 7.45 GiB, and a statistic makes a few copies
# of it (counts, each class's weights), so this bounds analysis memory at any size. It
# is reached from 263 rows on, so a bootstrap holds as much for a panel of 1,000 rows as
# for one of a million (analysis memory flat in the rows), and changes no draw.
MAX_BLOCK_CELLS = 1 << 18
MATRIX_WILSON_Z = 1.96
TRANSPLANT_WILSON_Z = 1.959963984540054


def wilson_interval(count: int, n: int, z: float = MATRIX_WILSON_Z) -> tuple[float, float]:
    """Wilson score interval for count/n, clipped to [0, 1]; n = 0 gives (0, 0).

    Wilson rather than Wald because the paper's headline rates sit at 0 and near
    1, where a Wald interval collapses to a point.
    """
    if n == 0:
        return 0.0, 0.0
    p = count / n
    z2 = z * z
    denominator = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half_width = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denominator
    return max(0.0, centre - half_width), min(1.0, centre + half_width)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p on discordant counts b and c.

    min(1, 2 * P[Binomial(b + c, 1/2) <= min(b, c)]), 1.0 when b + c = 0;
    computed with exact integers so large panels do not underflow.
    """
    total = b + c
    if total == 0:
        return 1.0
    tail = sum(math.comb(total, k) for k in range(min(b, c) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**total)))


def paired_bootstrap_ci_pp(values: ArrayLike, stream: int) -> tuple[float, float]:
    """Percentile 95% interval (in points) of the mean of a per-row vector.

    Reproduces the paper's method draw for draw: default_rng(seed + stream), 20,000
    replicates in blocks of 1,000, each block one integers(0, n, (block, n))
    call used as row indices, numpy's default quantile at 0.025 and 0.975.
    """
    x = np.asarray(values, dtype=np.float64)
    n = x.shape[0]
    if n == 0:
        raise ValueError("the paired bootstrap needs at least one row")
    replicates = np.concatenate(
        [x[indices].mean(axis=1) for indices in bootstrap_index_blocks(n, stream)]
    )
    low, high = np.quantile(replicates * 100.0, [0.025, 0.975])
    return float(low), float(high)


def bootstrap_index_blocks(n: int, stream: int) -> Iterator[np.ndarray]:
    """the paper's resamples of n rows: (block, n) row-index matrices from one seeded stream.

    Every row bootstrap in kvreplay draws through here, so a statistic's interval
    is reproducible draw for draw from its stream number alone. Blocks hold 1,000
    resamples, or fewer when that many would exceed ``MAX_BLOCK_CELLS`` indices: numpy
    draws the same stream whatever the size of each call, so the resamples, and every
    statistic computed one resample at a time, are the same for any block size.
    """
    rng = np.random.default_rng(BOOTSTRAP_SEED + stream)
    block = max(1, min(BOOTSTRAP_BLOCK, MAX_BLOCK_CELLS // n))
    for start in range(0, BOOTSTRAP_REPLICATES, block):
        yield rng.integers(0, n, size=(min(block, BOOTSTRAP_REPLICATES - start), n))


@dataclass(frozen=True)
class BootstrapInterval:
    """Percentile 95% interval and how many resamples had the statistic defined."""

    low: float
    high: float
    defined_replicates: int


def row_bootstrap_ci(
    statistic: Callable[[np.ndarray], np.ndarray], n: int, stream: int
) -> BootstrapInterval | None:
    """Percentile 95% interval of any row statistic over the paper's resamples.

    ``statistic`` maps a (block, n) index matrix to one value per resample, NaN
    where the resample leaves it undefined (an AUC with no positive row); those
    resamples are dropped and counted. None when no resample is defined.
    """
    if n == 0:
        return None
    values = np.concatenate([statistic(indices) for indices in bootstrap_index_blocks(n, stream)])
    values = values[~np.isnan(values)]
    if not values.size:
        return None
    low, high = np.quantile(values, [0.025, 0.975])
    return BootstrapInterval(float(low), float(high), int(values.size))


def mann_whitney_auc(scores: ArrayLike, labels: ArrayLike) -> float | None:
    """ROC AUC as P(score of a positive > score of a negative), ties counted half.

    The Mann-Whitney form needs no threshold sweep and treats tied scores
    exactly; None when either class is empty, where the AUC is undefined.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    positive, negative = s[y], s[~y]
    if not positive.size or not negative.size:
        return None
    negative = np.sort(negative)  # counted by search: no positives x negatives matrix
    below = np.searchsorted(negative, positive, side="left")
    tied = np.searchsorted(negative, positive, side="right") - below
    return float((int(below.sum()) + 0.5 * int(tied.sum())) / (positive.size * negative.size))


def newcombe_paired_difference_ci(
    first: ArrayLike, second: ArrayLike, z: float = MATRIX_WILSON_Z
) -> tuple[float, float]:
    """Newcombe (1998) method 10 interval for p_first - p_second on paired 0/1 rows.

    A closed-form companion to the bootstrap: it combines the two marginal
    Wilson intervals with the phi correlation of the pairs, so it stays inside
    [-1, 1] and behaves at zero discordance. Phi is taken as 0 when any
    margin is empty.
    """
    x = np.asarray(first, dtype=bool)
    y = np.asarray(second, dtype=bool)
    n = x.shape[0]
    if n == 0 or y.shape[0] != n:
        raise ValueError("Newcombe's interval needs two equal-length, non-empty vectors")
    a = int(np.sum(x & y))
    b = int(np.sum(x & ~y))
    c = int(np.sum(~x & y))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    epsilon = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    difference = p1 - p2
    return max(-1.0, difference - delta), min(1.0, difference + epsilon)
