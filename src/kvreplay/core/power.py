"""The power of a pass (design: power): how large a divergence rate a check's items rule
out. A check that saw k divergent items of n has not shown the rate is 0; it has shown,
at 95% confidence, that the rate is at most the exact (Clopper-Pearson) upper bound of
k of n. With 0 of 4 that bound is 60%: a pass on four items says little, and the
verdict says so. ``--max-rate R`` turns the bound around: run as many items as a pass
needs to put it under R.

Pure arithmetic (no numpy), so a verdict costs nothing to import.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95
TAIL = (1 - CONFIDENCE) / 2  # two-sided: the upper bound leaves 2.5% above it


def rate_upper_bound(divergent: int, items: int) -> float:
    """The exact 95% upper bound on the divergence rate after ``divergent`` of ``items``;
    1 when nothing was compared."""
    if items <= 0 or divergent >= items:
        return 1.0
    if divergent == 0:  # closed form: (1 - p)^n = TAIL
        return 1 - TAIL ** (1 / items)
    low, high = divergent / items, 1.0
    for _ in range(200):  # bisection on P(X <= divergent | p) = TAIL, decreasing in p
        middle = (low + high) / 2
        if _binomial_cdf(divergent, items, middle) > TAIL:
            low = middle
        else:
            high = middle
    return high


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (large n stays finite)."""
    if p <= 0:
        return 1.0
    if p >= 1:
        return 0.0
    total = 0.0
    for i in range(k + 1):
        log_term = (
            math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + i * math.log(p) + (n - i) * math.log1p(-p)
        )  # fmt: skip
        total += math.exp(log_term)
    return min(total, 1.0)


def items_needed(max_rate: float, allowed: int = 0) -> int:
    """The fewest items whose pass with ``allowed`` divergent ones bounds the rate under
    ``max_rate``."""
    if allowed == 0:
        n = max(1, math.ceil(math.log(TAIL) / math.log1p(-max_rate)))
        while rate_upper_bound(0, n) >= max_rate:
            n += 1
        return n
    low, high = allowed + 1, allowed + 1
    while rate_upper_bound(allowed, high) >= max_rate:
        low, high = high, high * 2
    while low < high:  # the bound falls as items grow: the first n under max_rate
        middle = (low + high) // 2
        if rate_upper_bound(allowed, middle) < max_rate:
            high = middle
        else:
            low = middle + 1
    return high


def percent(rate: float) -> str:
    """A bound as people read it: 60%, 4.99%, 0.368%."""
    value = 100 * rate
    return f"{value:.3g}%" if value < 10 else f"{value:.0f}%"
