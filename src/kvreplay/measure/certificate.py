"""The resample certificate: do outcomes resampled from a rebuilt (prefill) state follow
the distribution of outcomes resampled from the live state, within a margin?

Data: per item, K seeds; seed k drove one live and one prefill sample (a pair). Items
are fixed; the seeds are the random draws. Everything is pure numpy with seeded
generators, so a claims file regenerates bit for bit. alpha = 0.05 throughout.

- Paired: the share of seeds whose token sequence changed, with a Wilson interval, and
  exact McNemar on the per-seed correctness pairs.
- Accuracy difference (prefill - live), pooled as the mean over items; its standard
  error adds half a pair to each cell of every item's 2x2 table (Agresti-Min), so a
  table with no discordant pair still has a positive error. TOST: equivalent when the
  90% interval lies inside (-margin, margin); shown different when it lies outside.
- TV distance between the two answer distributions (unparsed answers form one
  category), pooled as the mean over items of each item's TV. Interval: percentile
  bootstrap, seeds resampled in pairs within each item. Equal distributions: a
  permutation test that swaps the two answers of each pair at random (statistic: the
  pooled TV).
- TV upper bound for TOST, the smaller of two, each at alpha/2 (Bonferroni):
  the coupling bound (the pairs share a seed, so TV <= P(the pair's answers differ):
  a Wilson upper bound on that share), and the bootstrap's upper percentile, used only
  once 10 or more pairs' answers differ (below that a resample of a count is too
  coarse, and the coupling bound is tight anyway). The empirical TV is biased upward,
  which makes the bootstrap bound conservative.
- Verdict: *faithful within the margin* when both TOSTs pass (accuracy interval inside
  the margin and TV upper bound below it); *not faithful* when the accuracy interval
  lies outside the margin, or equality is rejected by the permutation test and the
  TV interval lies above the margin; otherwise *undecided*, with the samples per item
  that would decide it at power 0.8: each bound's half-width is projected with
  1/sqrt(K) at the measured spread (the coupling bound at the measured share). A TV
  refutation is projected from the TV in excess of the permutation mean, the TV that
  equal distributions give at this K: the plug-in TV of small samples from a wide
  answer distribution is far above zero even when nothing changed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from kvreplay.measure.rates import Rate
from kvreplay.measure.stats import MATRIX_WILSON_Z, mcnemar_exact_p, wilson_interval

ALPHA = 0.05
POWER = 0.8
REPLICATES = 2_000
CERTIFICATE_SEED = 20261203
MIN_DISCORDANT_FOR_BOOTSTRAP = 10
MAX_SAMPLES = 1_000_000
POWER_MARGINS = (0.02, 0.05, 0.1, 0.2)
FAITHFUL, NOT_FAITHFUL, UNDECIDED = "faithful", "not faithful", "undecided"

_Z = NormalDist().inv_cdf
Z_TOST = _Z(1 - ALPHA)  # one-sided, accuracy
Z_HALF = _Z(1 - ALPHA / 2)  # one-sided at alpha/2: each of the two TV bounds
Z_POWER = _Z(POWER)


def tv_distance(left: Sequence[Any], right: Sequence[Any]) -> float:
    """Total variation distance between two empirical distributions of outcomes.

    fsum, because the outcomes come in set order (which follows the hash seed) and a
    plain float sum would then differ in its last bits from one process to the next."""
    a, b = Counter(left), Counter(right)
    return math.fsum(abs(a[x] / len(left) - b[x] / len(right)) for x in a.keys() | b.keys()) / 2


@dataclass(frozen=True)
class PairedSamples:
    """One item's K paired samples: each seed's answer (None: unparsed) and correctness
    in the live and the prefill arm, and whether the seed's token sequence changed."""

    item: str
    live: tuple[str | None, ...]
    prefill: tuple[str | None, ...]
    live_correct: tuple[bool, ...]
    prefill_correct: tuple[bool, ...]
    changed: tuple[bool, ...]

    def __post_init__(self) -> None:
        sizes = {len(self.live), len(self.prefill), len(self.live_correct)}
        sizes |= {len(self.prefill_correct), len(self.changed)}
        if len(sizes) != 1 or not self.live:
            raise ValueError(f"item {self.item}: every per-seed list needs the same length >= 1")

    @property
    def k(self) -> int:
        return len(self.live)

    def codes(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Both arms' answers as integer categories, and how many categories there are."""
        names = {a: i for i, a in enumerate(dict.fromkeys(self.live + self.prefill))}
        live = np.array([names[a] for a in self.live])
        return live, np.array([names[a] for a in self.prefill]), len(names)


def _tv_codes(left: np.ndarray, right: np.ndarray, categories: int) -> np.ndarray:
    """TV of each row of two (..., K) category matrices."""
    onehot = np.arange(categories)
    counts = (left[..., None] == onehot).sum(-2) - (right[..., None] == onehot).sum(-2)
    return np.abs(counts).sum(-1) / (2 * left.shape[-1])


def _pooled_tv_draws(
    items: Sequence[PairedSamples], seed: int, permute: bool, replicates: int
) -> np.ndarray:
    """Pooled TV over seeded resamples: pairs drawn with replacement within each item
    (bootstrap), or each pair's two answers swapped at random (permutation)."""
    rng = np.random.default_rng(seed)
    total = np.zeros(replicates)
    for item in items:
        live, prefill, categories = item.codes()
        if permute:
            swap = rng.random((replicates, item.k)) < 0.5
            left, right = np.where(swap, prefill, live), np.where(swap, live, prefill)
        else:
            index = rng.integers(0, item.k, size=(replicates, item.k))
            left, right = live[index], prefill[index]
        total += _tv_codes(left, right, categories)
    return total / len(items)


def _smallest(holds: Callable[[float], bool]) -> int | None:
    """The smallest samples per item at which ``holds`` (monotone), or None past MAX_SAMPLES."""
    high = 1
    while not holds(high):
        high *= 2
        if high > MAX_SAMPLES:
            return None
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


@dataclass(frozen=True)
class Measured:
    """What the samples measured, pooled over items; what verdicts and projections read."""

    items: int
    k: int
    pairs: int
    changed: int
    answers_changed: int
    live_only_correct: int
    prefill_only_correct: int
    accuracy_difference: float
    accuracy_se: float
    tv: float
    tv_ci: tuple[float, float]
    tv_se: float
    tv_null: float  # the pooled TV that equal distributions give at these K (plug-in bias)
    permutation_p: float

    def samples_for(self, margin: float) -> dict[str, int | None]:
        """Samples per item at which each equivalence test passes at power 0.8, given
        the measured estimates; None where it cannot at these estimates."""
        accuracy = _smallest(
            lambda k: (
                abs(self.accuracy_difference)
                + (Z_TOST + Z_POWER) * self.accuracy_se * np.sqrt(self.k / k)
                < margin
            )
        )
        share = self.answers_changed / self.pairs
        coupling = _smallest(
            lambda k: (
                wilson_interval(share * self.items * k, self.items * k, Z_HALF + Z_POWER)[1]
                < margin
            )
        )
        bootstrap = (
            _smallest(
                lambda k: self.tv + (Z_HALF + Z_POWER) * self.tv_se * np.sqrt(self.k / k) < margin
            )
            if self.answers_changed >= MIN_DISCORDANT_FOR_BOOTSTRAP
            else None
        )
        tv = min((k for k in (coupling, bootstrap) if k is not None), default=None)
        faithful = None if accuracy is None or tv is None else max(accuracy, tv)
        return {"accuracy": accuracy, "tv": tv, "faithful": faithful}

    def samples_to_refute(self, margin: float) -> int | None:
        """Samples per item at which the difference would be shown above the margin. The
        TV must exceed the margin beyond what equal distributions give at this K (the
        plug-in TV of two samples of one wide distribution is far above zero)."""
        candidates = [
            _smallest(lambda k: abs(self.accuracy_difference)
                      - (Z_TOST + Z_POWER) * self.accuracy_se * np.sqrt(self.k / k) > margin),
            _smallest(lambda k: self.tv - self.tv_null
                      - (Z_HALF + Z_POWER) * self.tv_se * np.sqrt(self.k / k) > margin),
        ]  # fmt: skip
        return min((k for k in candidates if k is not None), default=None)


def _discordant(item: PairedSamples) -> tuple[int, int]:
    """Seeds correct in the live arm only, and in the prefill arm only."""
    pairs = list(zip(item.live_correct, item.prefill_correct, strict=True))
    return sum(a and not b for a, b in pairs), sum(b and not a for a, b in pairs)


def accuracy_difference(items: Sequence[PairedSamples]) -> tuple[float, float]:
    """Prefill minus live accuracy, the mean over items, and its standard error with
    half a pair added to each cell of every item's 2x2 table (Agresti-Min)."""
    variance, differences = 0.0, []
    for item in items:
        b, c = _discordant(item)
        differences.append((c - b) / item.k)
        n, b_adj, c_adj = item.k + 2, b + 0.5, c + 0.5
        variance += ((b_adj + c_adj) / n - ((c_adj - b_adj) / n) ** 2) / n
    return float(np.mean(differences)), float(np.sqrt(variance) / len(items))


def measure(
    items: Sequence[PairedSamples], seed: int = CERTIFICATE_SEED, replicates: int = REPLICATES
) -> Measured:
    """Pool the items' paired samples into the estimates the certificate needs."""
    difference, se = accuracy_difference(items)
    discordant = [_discordant(item) for item in items]
    observed = float(np.mean([tv_distance(i.live, i.prefill) for i in items]))
    bootstrap = _pooled_tv_draws(items, seed, False, replicates)
    permuted = _pooled_tv_draws(items, seed + 1, True, replicates)
    low, high = np.quantile(bootstrap, [ALPHA / 2, 1 - ALPHA / 2])
    return Measured(
        items=len(items),
        k=min(i.k for i in items),
        pairs=sum(i.k for i in items),
        changed=sum(sum(i.changed) for i in items),
        answers_changed=sum(
            sum(a != b for a, b in zip(i.live, i.prefill, strict=True)) for i in items
        ),
        live_only_correct=sum(b for b, _ in discordant),
        prefill_only_correct=sum(c for _, c in discordant),
        accuracy_difference=difference,
        accuracy_se=se,
        tv=observed,
        tv_ci=(float(low), float(high)),
        tv_se=float(np.std(bootstrap)),
        tv_null=float(np.mean(permuted)),
        permutation_p=float((1 + np.sum(permuted >= observed - 1e-12)) / (1 + replicates)),
    )


@dataclass(frozen=True)
class Certificate:
    """The verdict on one set of items at one margin, and the evidence behind it."""

    margin: float
    measured: Measured
    verdict: str
    accuracy_ci90: tuple[float, float]
    tv_upper: float
    more_samples: int | None  # per item, when undecided

    def sentence(self) -> str:
        m = self.measured
        share = f"{m.changed}/{m.pairs} seeds changed"
        if self.verdict == FAITHFUL:
            return (
                f"Faithful within the margin {self.margin:g}: over {m.items} item(s) x {m.k} "
                f"seeds, TV distance is at most {self.tv_upper:.3f} and the accuracy change "
                f"lies in [{self.accuracy_ci90[0]:+.3f}, {self.accuracy_ci90[1]:+.3f}] "
                f"({share})."
            )
        if self.verdict == NOT_FAITHFUL:
            return (
                f"Not faithful: over {m.items} item(s) x {m.k} seeds the prefill state's "
                f"outcomes differ from the live state's by more than {self.margin:g} (TV "
                f"{m.tv:.3f}, 95% CI [{m.tv_ci[0]:.3f}, {m.tv_ci[1]:.3f}]; accuracy change "
                f"{m.accuracy_difference:+.3f}; {share})."
            )
        need = (
            f"need about {self.more_samples} more samples per item"
            if self.more_samples is not None
            else "no feasible number of samples decides it at these estimates"
        )
        accuracy = (
            "the accuracy change is equivalent to 0 within the margin, in"
            if -self.margin < self.accuracy_ci90[0] and self.accuracy_ci90[1] < self.margin
            else "accuracy change in"
        )
        return (
            f"Undecided at the margin {self.margin:g}: {need} (now {m.k}; TV {m.tv:.3f}, "
            f"upper bound {self.tv_upper:.3f}, against {m.tv_null:.3f} that equal "
            f"distributions give at this K; {accuracy} "
            f"[{self.accuracy_ci90[0]:+.3f}, {self.accuracy_ci90[1]:+.3f}]; {share})."
        )

    def claims(self) -> CertificateClaims:
        """The certificate as claims.json and a check's JSON hold it."""
        m = self.measured
        return CertificateClaims(
            verdict=self.verdict,
            sentence=self.sentence(),
            margin=self.margin,
            alpha=ALPHA,
            items=m.items,
            samples_per_item=m.k,
            more_samples_per_item=self.more_samples,
            seeds_changed=Rate.of(m.changed, m.pairs, MATRIX_WILSON_Z),
            answers_changed=m.answers_changed,
            mcnemar=McNemar(
                m.live_only_correct,
                m.prefill_only_correct,
                mcnemar_exact_p(m.live_only_correct, m.prefill_only_correct),
            ),
            accuracy_difference_prefill_minus_live=AccuracyDifference(
                float(m.accuracy_difference), float(m.accuracy_se), _pair(self.accuracy_ci90)
            ),
            tv_distance=TvDistance(
                float(m.tv),
                _pair(m.tv_ci),
                float(self.tv_upper),
                float(m.tv_null),
                float(m.permutation_p),
            ),  # fmt: skip
            power=[
                Power(margin, SamplesNeeded(**m.samples_for(margin))) for margin in POWER_MARGINS
            ],
        )


def _pair(values: tuple[float, float]) -> tuple[float, float]:
    return float(values[0]), float(values[1])


@dataclass(frozen=True)
class McNemar:
    """Exact McNemar on per-seed correctness: the discordant seeds, and its p."""

    live_only_correct: int
    prefill_only_correct: int
    exact_two_sided_p: float


@dataclass(frozen=True)
class AccuracyDifference:
    """Prefill minus live accuracy, its standard error and its TOST 90% interval."""

    estimate: float
    se: float
    tost_90_ci: tuple[float, float]


@dataclass(frozen=True)
class TvDistance:
    """The pooled TV distance, its bootstrap interval, its TOST upper bound, the TV equal
    distributions give at these K, and the permutation test's p."""

    estimate: float
    bootstrap_95_ci: tuple[float, float]
    tost_upper_bound: float
    equal_distributions_mean: float
    permutation_p: float


@dataclass(frozen=True)
class SamplesNeeded:
    """Samples per item at which each test would pass at power 0.8 (None: none would)."""

    accuracy: int | None
    tv: int | None
    faithful: int | None


@dataclass(frozen=True)
class Power:
    margin: float
    samples_per_item: SamplesNeeded


@dataclass(frozen=True)
class CertificateClaims:
    """The verdict on one set of items at one margin, with its sentence and evidence."""

    verdict: str
    sentence: str
    margin: float
    alpha: float
    items: int
    samples_per_item: int
    more_samples_per_item: int | None
    seeds_changed: Rate
    answers_changed: int
    mcnemar: McNemar
    accuracy_difference_prefill_minus_live: AccuracyDifference
    tv_distance: TvDistance
    power: list[Power]


def certify(
    items: Sequence[PairedSamples],
    margin: float,
    seed: int = CERTIFICATE_SEED,
    replicates: int = REPLICATES,
) -> Certificate:
    """The certificate of ``items`` (one item, or every item of a precision) at ``margin``."""
    m = measure(items, seed, replicates)
    half = Z_TOST * m.accuracy_se
    ci90 = (m.accuracy_difference - half, m.accuracy_difference + half)
    coupling = wilson_interval(m.answers_changed, m.pairs, Z_HALF)[1]
    bootstrap = m.tv_ci[1] if m.answers_changed >= MIN_DISCORDANT_FOR_BOOTSTRAP else 1.0
    tv_upper = min(coupling, bootstrap)
    more = None
    if -margin < ci90[0] and ci90[1] < margin and tv_upper < margin:
        verdict = FAITHFUL
    elif ci90[0] > margin or ci90[1] < -margin or (m.permutation_p < ALPHA and m.tv_ci[0] > margin):
        verdict = NOT_FAITHFUL
    else:
        verdict = UNDECIDED
        options = [k for k in (m.samples_for(margin)["faithful"], m.samples_to_refute(margin)) if k]
        more = max(min(options) - m.k, 1) if options else None
    return Certificate(margin, m, verdict, ci90, tv_upper, more)
