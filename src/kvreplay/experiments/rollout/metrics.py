"""The training-inference mismatch (design: mismatch), each metric defined once, here, as
RL frameworks log it, and computed a sequence at a time with bounded state: any length,
any number of sequences (:mod:`kvreplay.measure.streamed`).

A *pair* is two sides' log-probabilities of the same sampled tokens, sequence by
sequence: the rollout side (what the sampler reported while it decoded) and the scorer
side (a teacher-forced prefill of the same ids). Per token,

    delta = log p_scorer - log p_rollout,   ratio = exp(delta) = p_scorer / p_rollout,

so delta > 0 where the trainer finds a token likelier than the sampler did; only the
tokens a sequence's mask keeps count (its response tokens, not its prompt, padding or
tool output). Every metric of :data:`METRICS` is a function of the pairs alone; its
``known_as`` names what verl, TRL, prime-rl and NeMo-RL log under the same definition.
Each block of sequences is summed by numpy and the blocks by :func:`math.fsum`, the
order statistics are exact, so a claims file re-derives bit for bit from the same
rollouts. The
*decomposition* of a total delta into terms that add up lives here too
(:class:`ChainTally`), with paired intervals that resample whole sequences, since a
sequence's tokens are not independent.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvreplay.core.errors import KvreplayError
from kvreplay.measure.streamed import Interval, Spill, Sums, mean_interval, quantiles

DEFAULT_CAP = 2.0
"""The importance-ratio cap of token-level truncated and masked importance sampling
(TIS, MIS): a token whose ratio exceeds it is truncated (or, outside [1/cap, cap],
masked)."""
VERL_SEQUENCE_THRESHOLD = 2.0
"""verl's default correction (``algorithm.rollout_correction``: ``rollout_is="sequence"``,
``rollout_is_threshold=2.0``): one weight per sequence, the product of its token ratios,
truncated at 2."""
TRL_SEQUENCE_CAP = 3.0
"""TRL GRPO's default correction (``vllm_importance_sampling_mode="sequence_mask"``,
``vllm_importance_sampling_clip_max=3.0``, no lower bound): a sequence whose product
ratio exceeds 3 is masked out."""
SAFETY_BOUND = 20.0  # verl clamps a log ratio to [-20, 20] before exp (rollout_corr_helper)
EXP_LIMIT = 300.0
"""exp's argument is capped here (exp(300) is about 2e130), so that no sum of a metric,
and no square of a sequence's sum an interval takes, overflows; a delta past it is past
any mismatch a gate tells apart, and past the least log-probability
(:data:`~kvreplay.core.rollout.LOGPROB_FLOOR`, -3.4e38), so k3 stays positive."""

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
POSITION_BINS = 8  # where along the sequence: eighths of its length
MARGIN_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, 4.0, math.inf)
"""Bins of the scorer's top-1/top-2 log-probability gap at a token (nats)."""
BLOCK_TOKENS = 1 << 16  # tokens gathered before a pass over them


def _exp(values: np.ndarray) -> np.ndarray:
    return np.exp(np.minimum(values, EXP_LIMIT))


def _ratio(delta: float) -> float:
    return math.exp(min(delta, EXP_LIMIT))


# The per-token sums a pair keeps, by name; the second moments are of values shifted
# by the pair's first token's (``shift``), which keeps them from cancelling.
SUMS = (
    "delta",
    "abs_delta",
    "abs_dp",
    "k3",
    "ratio_squared",
    "exp_abs_delta",
    "abs_dp_shifted",
    "abs_dp_shifted_squared",
    "p_rollout_shifted",
    "p_scorer_shifted",
    "p_rollout_shifted_squared",
    "p_scorer_shifted_squared",
    "p_product_shifted",
)
_SUM = {name: index for index, name in enumerate(SUMS)}


@dataclass
class Totals:
    """What every metric is a function of: a pair's sums and counts, its maxima, its
    ratio quantiles, and per sequence the sum of delta, the tokens and each side's mean
    log-probability."""

    tokens: int
    cap: float
    sums: dict[str, float]
    counts: dict[str, int]
    maxima: dict[str, float]
    ratio_quantiles: dict[float, float]
    seq_log_ratio: np.ndarray
    seq_tokens: np.ndarray
    seq_mean_rollout: np.ndarray
    seq_mean_scorer: np.ndarray
    constant: tuple[bool, bool]  # each side's probabilities the same at every token

    @property
    def sequences(self) -> int:
        return int(self.seq_tokens.size)

    def mean(self, name: str) -> float:
        return self.sums[name] / self.tokens

    def share(self, name: str) -> float:
        return self.counts[name] / self.tokens


def _std(t: Totals) -> float | None:
    if t.tokens < 2:
        return None
    total, squares = t.sums["abs_dp_shifted"], t.sums["abs_dp_shifted_squared"]
    return math.sqrt(max((squares - total * total / t.tokens) / (t.tokens - 1), 0.0))


def _pearson(t: Totals) -> float | None:
    """Pearson's r of the two sides' probabilities; None where either is constant."""
    if t.tokens < 2 or any(t.constant):
        return None
    n, x, y = t.tokens, t.sums["p_rollout_shifted"], t.sums["p_scorer_shifted"]
    covariance = t.sums["p_product_shifted"] - x * y / n
    spread = (t.sums["p_rollout_shifted_squared"] - x * x / n) * (
        t.sums["p_scorer_shifted_squared"] - y * y / n
    )
    if spread <= 0:
        return None
    return max(-1.0, min(1.0, covariance / math.sqrt(spread)))


def _seq_mean(values: np.ndarray) -> float:
    return math.fsum(values.tolist()) / values.size


def _clamped(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -SAFETY_BOUND, SAFETY_BOUND)


def _ess(t: Totals) -> float:
    weights = np.exp(_clamped(t.seq_log_ratio))
    return math.fsum(weights.tolist()) ** 2 / (t.sequences * math.fsum((weights**2).tolist()))


@dataclass(frozen=True)
class Metric:
    """One metric: its name in kvreplay's tables, its definition (as the docs give it),
    what RL frameworks call it, its level (a token's or a sequence's), and how it is
    computed from a pair's totals."""

    name: str
    definition: str
    known_as: str
    compute: Callable[[Totals], float | None]
    level: str = "token"


METRICS: tuple[Metric, ...] = (
    Metric("tokens", "scored tokens (those the mask keeps)", "", lambda t: float(t.tokens)),
    Metric("sequences", "scored sequences", "", lambda t: float(t.sequences), "sequence"),
    Metric(
        "logp_diff_mean",
        "mean of delta (signed): above 0 the scorer finds the sampled tokens likelier",
        "",
        lambda t: t.mean("delta"),
    ),
    Metric(
        "abs_logp_mean",
        "mean of |delta|",
        "TRL sampling/sampling_logp_difference/mean",
        lambda t: t.mean("abs_delta"),
    ),
    Metric(
        "abs_logp_max",
        "largest |delta|",
        "TRL sampling/sampling_logp_difference/max",
        lambda t: t.maxima["abs_delta"],
    ),
    Metric(
        "probs_diff_mean",
        "mean of |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_mean",
        lambda t: t.mean("abs_dp"),
    ),
    Metric(
        "probs_diff_max",
        "largest |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_max",
        lambda t: t.maxima["abs_dp"],
    ),
    Metric(
        "probs_diff_std",
        "sample standard deviation (n - 1) of |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_std",
        _std,
    ),
    Metric(
        "probs_pearson",
        "Pearson correlation of p_rollout and p_scorer over tokens (empty where one side "
        "is constant)",
        "verl training/rollout_actor_probs_pearson_corr",
        _pearson,
    ),
    Metric(
        "kl_k1",
        "mean of -delta: the k1 estimator of KL(rollout || scorer) from the sampled tokens",
        "verl rollout_corr/kl",
        lambda t: -t.mean("delta"),
    ),
    Metric(
        "kl_k3",
        "mean of ratio - 1 - delta: the k3 estimator of KL(rollout || scorer), never below 0",
        "verl rollout_corr/k3_kl; prime-rl mismatch_kl (per token)",
        lambda t: t.mean("k3"),
    ),
    Metric(
        "token_mult_prob_error",
        "mean of exp(|delta|): how many times likelier one side finds a token, on average",
        "NeMo-RL token_mult_prob_error",
        lambda t: t.mean("exp_abs_delta"),
    ),
    Metric(
        "seq_log_ratio_mean",
        "mean over sequences of the sum of delta (the log of the sequence importance ratio)",
        "",
        lambda t: _seq_mean(t.seq_log_ratio),
        "sequence",
    ),
    Metric(
        "seq_log_ratio_abs_max",
        "largest |sum of delta| of a sequence",
        "",
        lambda t: float(np.max(np.abs(t.seq_log_ratio))),
        "sequence",
    ),
    *(
        Metric(
            f"ratio_q{round(q * 100):02d}",
            f"the {q:g} quantile of the token importance ratio exp(delta)",
            "",
            lambda t, q=q: t.ratio_quantiles[q],
        )
        for q in QUANTILES
    ),
    Metric(
        "ratio_above_cap",
        "share of tokens whose ratio exceeds the cap (what truncated IS truncates)",
        "TIS truncation share",
        lambda t: t.share("above_cap"),
    ),
    Metric(
        "ratio_outside_cap",
        "share of tokens whose ratio lies outside [1/cap, cap] (what masked IS masks)",
        "verl rollout_rs_masked_fraction (token)",
        lambda t: t.share("outside_cap"),
    ),
    Metric(
        "ppl_rollout",
        "mean over sequences of exp(-mean log p_rollout): each sequence's perplexity, averaged",
        "verl rollout_corr/rollout_ppl",
        lambda t: _seq_mean(_exp(-t.seq_mean_rollout)),
        "sequence",
    ),
    Metric(
        "ppl_scorer",
        "mean over sequences of exp(-mean log p_scorer)",
        "verl rollout_corr/training_ppl",
        lambda t: _seq_mean(_exp(-t.seq_mean_scorer)),
        "sequence",
    ),
    Metric(
        "chi2_token",
        "mean of ratio**2, less 1: the token-level chi-squared divergence",
        "verl rollout_corr/chi2_token (verl clamps delta to [-20, 20] first)",
        lambda t: t.mean("ratio_squared") - 1,
    ),
    Metric(
        "tokens_bit_equal",
        "share of tokens whose two log-probabilities are the same float (delta exactly 0)",
        "",
        lambda t: t.share("bit_equal"),
    ),
    Metric(
        "seq_ratio_min",
        "smallest sequence importance ratio: the product of its tokens' ratios, exp(sum of delta)",
        "verl rollout_corr/rollout_is_min (rollout_is=sequence)",
        lambda t: float(_exp(np.min(t.seq_log_ratio))),
        "sequence",
    ),
    Metric(
        "seq_ratio_median",
        "median sequence importance ratio exp(sum of delta)",
        "",
        lambda t: float(_exp(np.median(t.seq_log_ratio))),
        "sequence",
    ),
    Metric(
        "seq_ratio_max",
        "largest sequence importance ratio exp(sum of delta)",
        "verl rollout_corr/rollout_is_max (rollout_is=sequence; verl clamps at exp(20))",
        lambda t: float(_exp(np.max(t.seq_log_ratio))),
        "sequence",
    ),
    Metric(
        "seq_geo_ratio_min",
        "smallest geometric-mean ratio of a sequence, exp(mean of delta)",
        "verl rollout_rs=seq_mean_k1 reads its log",
        lambda t: float(_exp(np.min(t.seq_log_ratio / t.seq_tokens))),
        "sequence",
    ),
    Metric(
        "seq_geo_ratio_max",
        "largest geometric-mean ratio of a sequence, exp(mean of delta)",
        "",
        lambda t: float(_exp(np.max(t.seq_log_ratio / t.seq_tokens))),
        "sequence",
    ),
    Metric(
        "seq_truncated_verl",
        f"sequences whose importance ratio exceeds {VERL_SEQUENCE_THRESHOLD:g}, which "
        "verl's default correction truncates (sum of delta > log 2), a count",
        "verl rollout_corr/rollout_is_ratio_fraction_high x sequences (rollout_is=sequence)",
        lambda t: float(np.count_nonzero(t.seq_log_ratio > math.log(VERL_SEQUENCE_THRESHOLD))),
        "sequence",
    ),
    Metric(
        "seq_masked_trl",
        f"sequences whose importance ratio exceeds {TRL_SEQUENCE_CAP:g}, which TRL's default "
        "correction masks out (sequence_mask), a count",
        "TRL GRPO vllm_importance_sampling_mode=sequence_mask",
        lambda t: float(np.count_nonzero(np.exp(_clamped(t.seq_log_ratio)) > TRL_SEQUENCE_CAP)),
        "sequence",
    ),
    Metric(
        "chi2_seq",
        "mean over sequences of their importance ratio squared, less 1 (the log ratio "
        "clamped to [-20, 20]): the sequence-level chi-squared divergence",
        "verl rollout_corr/chi2_seq",
        lambda t: _seq_mean(np.exp(2 * _clamped(t.seq_log_ratio))) - 1,
        "sequence",
    ),
    Metric(
        "ess_seq",
        "effective sample size of the sequence importance ratios as a share of the "
        "sequences, (sum w)**2 / (n sum w**2), untruncated (log ratio clamped to [-20, 20])",
        "verl rollout_corr/rollout_is_eff_sample_size (verl's is truncated and per token)",
        _ess,
        "sequence",
    ),
)
METRIC_NAMES = tuple(m.name for m in METRICS)
COUNTS = ("tokens", "sequences", "seq_truncated_verl", "seq_masked_trl")
"""The metrics that are counts (a summary says them as counts)."""


@dataclass(frozen=True, slots=True)
class SequenceOutcome:
    """One sequence of a pair, judged alone: its key and group (the stack's precision,
    or ``logged``), its tokens, the first whose two log-probabilities differ (its index
    in the response; None: every one the same float), its k3 KL and largest |delta log
    p|, and where it came from (a logged rollout's step, rank, environment)."""

    key: str
    precision: str
    tokens: int
    first_differs: int | None
    kl_k3: float
    abs_logp_max: float
    where: dict[str, Any] = field(default_factory=dict)  # step, rank, environment

    @property
    def bits_equal(self) -> bool:
        return self.first_differs is None


class OutcomeTally:
    """What a verdict needs of a pair, pooled over groups: each sequence judged alone,
    and the pooled k3 KL with its interval and the largest |delta log p|."""

    def __init__(self) -> None:
        self.outcomes: list[SequenceOutcome] = []
        self.k3 = array("d")  # each sequence's, 8 bytes a value: the peak stays flat
        self.tokens = array("d")
        self.largest = 0.0
        self._places: dict[tuple, dict[str, Any]] = {}  # one dict per step, rank, environment

    def add(
        self,
        rollout: np.ndarray,
        scorer: np.ndarray,
        positions: np.ndarray,
        key: str,
        group: str,
        where: dict[str, Any],
    ) -> None:
        """One sequence's kept tokens on both sides and their places in the response."""
        if not rollout.size:
            return
        d = scorer - rollout
        magnitude = np.abs(d)
        total = float(np.sum(np.expm1(np.minimum(d, EXP_LIMIT)) - d))
        parted = np.flatnonzero(d)
        first = int(positions[parted[0]]) if parted.size else None
        top = float(magnitude.max())
        where = self._places.setdefault(tuple(where.items()), where)
        self.outcomes.append(SequenceOutcome(key, group, d.size, first, total / d.size, top, where))
        self.k3.append(total)
        self.tokens.append(float(d.size))
        self.largest = max(self.largest, top)

    @property
    def kl_k3(self) -> float:
        return math.fsum(self.k3) / math.fsum(self.tokens) if self.k3 else math.nan

    def k3_interval(self) -> Interval | None:
        """95% interval of the pooled k3 KL over resampled sequences (stream 0)."""
        return mean_interval(np.array(self.k3), np.array(self.tokens), 0)


@dataclass
class _Block:
    """Sequences gathered before a vectorised pass."""

    rollout: list[np.ndarray] = field(default_factory=list)
    scorer: list[np.ndarray] = field(default_factory=list)
    margins: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    tokens: int = 0


class PairTally:
    """One pair's metrics and where its differences sit (along the sequence, by the
    scorer's top-1/top-2 gap): fed a sequence at a time, holding at most a block of
    tokens, the per-sequence sums, and the spilled deltas the ratio quantiles are
    selected from."""

    _BINS = POSITION_BINS + len(MARGIN_EDGES) - 1

    def __init__(self, group: str, cap: float = DEFAULT_CAP):
        self.group, self.cap = group, cap
        self.block = _Block()
        self.sums = Sums(len(SUMS))
        self.bin_sums = Sums(self._BINS)
        self.shift: tuple[float, float, float] | None = None
        self.counts = {"above_cap": 0, "outside_cap": 0, "bit_equal": 0}
        self.maxima = {"abs_delta": 0.0, "abs_dp": 0.0}
        self.extremes = [math.inf, -math.inf, math.inf, -math.inf]  # each side's p: min, max
        self.bins = np.zeros((3, self._BINS))  # tokens, large, largest |delta|
        self.spill = Spill()
        self.tokens = 0
        self.seq = {k: array("d") for k in ("log_ratio", "tokens", "r", "s", "k3")}

    def add(
        self,
        rollout: np.ndarray,
        scorer: np.ndarray,
        positions: np.ndarray,
        length: int,
        margins: np.ndarray | None = None,
    ) -> None:
        """One sequence's kept tokens: both sides, each token's place in the response
        (of ``length`` tokens) and the scorer's gaps (None: not reported)."""
        if not rollout.size:
            return
        block = self.block
        block.rollout.append(rollout)
        block.scorer.append(scorer)
        block.margins.append(margins if margins is not None else np.full(rollout.size, np.nan))
        block.positions.append(positions)
        block.lengths.append(length)
        block.tokens += rollout.size
        if block.tokens >= BLOCK_TOKENS:
            self._flush()

    def _flush(self) -> None:
        block, self.block = self.block, _Block()
        if not block.tokens:
            return
        r, s = np.concatenate(block.rollout), np.concatenate(block.scorer)
        counts = np.array([a.size for a in block.rollout])
        seq = np.repeat(np.arange(counts.size), counts)
        d = s - r
        ad = np.abs(d)
        pr, ps = np.exp(r), np.exp(s)
        dp = np.abs(ps - pr)
        k3 = np.expm1(np.minimum(d, EXP_LIMIT)) - d
        if self.shift is None:
            self.shift = (float(dp[0]), float(pr[0]), float(ps[0]))
        sdp, spr, sps = dp - self.shift[0], pr - self.shift[1], ps - self.shift[2]
        self.sums.add(
            np.stack([d, ad, dp, k3, _exp(2 * np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)), _exp(ad),
                      sdp, sdp * sdp, spr, sps, spr * spr, sps * sps, spr * sps])
        )  # fmt: skip
        n = d.size
        large = ad > math.log(self.cap)
        ratio = _exp(d)  # past exp's range a ratio is beyond any cap anyway
        self.counts["above_cap"] += int(np.count_nonzero(ratio > self.cap))
        self.counts["outside_cap"] += int(
            np.count_nonzero((ratio > self.cap) | (ratio < 1 / self.cap))
        )
        self.counts["bit_equal"] += int(np.count_nonzero(d == 0))
        self.maxima["abs_delta"] = max(self.maxima["abs_delta"], float(ad.max()))
        self.maxima["abs_dp"] = max(self.maxima["abs_dp"], float(dp.max()))
        self.extremes = [
            min(self.extremes[0], float(pr.min())), max(self.extremes[1], float(pr.max())),
            min(self.extremes[2], float(ps.min())), max(self.extremes[3], float(ps.max())),
        ]  # fmt: skip
        self._bin(ad, large, np.concatenate(block.positions), np.repeat(block.lengths, counts),
                  np.concatenate(block.margins))  # fmt: skip
        self.spill.add(d)
        self.tokens += n
        sequences = counts.size
        for name, values in (("log_ratio", d), ("r", r), ("s", s), ("k3", k3)):
            self.seq[name].frombytes(
                np.bincount(seq, weights=values, minlength=sequences).tobytes()
            )
        self.seq["tokens"].frombytes(counts.astype(np.float64).tobytes())

    def _bin(
        self,
        ad: np.ndarray,
        large: np.ndarray,
        positions: np.ndarray,
        lengths: np.ndarray,
        margins: np.ndarray,
    ) -> None:
        eighth = np.minimum(positions * POSITION_BINS // np.maximum(lengths, 1), POSITION_BINS - 1)
        known = ~np.isnan(margins)
        gap = np.full(ad.size, -1)
        gap[known] = np.searchsorted(MARGIN_EDGES, margins[known], side="right") - 1
        for offset, where in ((0, eighth), (POSITION_BINS, gap)):
            chosen = where >= 0
            bins = where[chosen] + offset
            values = ad[chosen]
            self.bin_sums.add_totals(np.bincount(bins, weights=values, minlength=self._BINS))
            self.bins[0] += np.bincount(bins, minlength=self._BINS)
            self.bins[1] += np.bincount(bins, weights=large[chosen], minlength=self._BINS)
            top = np.full(self._BINS, -np.inf)
            np.maximum.at(top, bins, values)
            self.bins[2] = np.maximum(self.bins[2], top)

    def totals(self) -> Totals:
        self._flush()
        found = quantiles(self.spill, QUANTILES, _ratio) if self.tokens else []
        self.spill.close()
        seq_tokens = np.array(self.seq["tokens"])
        return Totals(
            self.tokens,
            self.cap,
            {name: self.sums.value(i) for i, name in enumerate(SUMS)},
            dict(self.counts),
            dict(self.maxima),
            dict(zip(QUANTILES, found, strict=False)),
            np.array(self.seq["log_ratio"]),
            seq_tokens,
            np.array(self.seq["r"]) / np.maximum(seq_tokens, 1),
            np.array(self.seq["s"]) / np.maximum(seq_tokens, 1),
            (self.extremes[0] == self.extremes[1], self.extremes[2] == self.extremes[3]),
        )

    def by_position(self) -> list[dict[str, float | int]]:
        """Per eighth of each sequence's length: its tokens, their mean |delta|, largest
        |delta| and how many are large (ratio outside [1/cap, cap])."""
        return [{"eighth": b, **self._bin_row(b)} for b in range(POSITION_BINS)]

    def by_margin(self) -> list[dict[str, float | int | None]]:
        """Per bin of :data:`MARGIN_EDGES` (the last one open: ``margin_to`` None)."""
        rows: list[dict[str, float | int | None]] = []
        for b in range(len(MARGIN_EDGES) - 1):
            upper = MARGIN_EDGES[b + 1]
            row: dict[str, float | int | None] = {**self._bin_row(POSITION_BINS + b)}
            row["margin_from"] = MARGIN_EDGES[b]
            row["margin_to"] = upper if upper < math.inf else None
            rows.append(row)
        return rows

    def _bin_row(self, index: int) -> dict[str, float | int]:
        count = int(self.bins[0, index])
        return {
            "tokens": count,
            "abs_logp_mean": self.bin_sums.value(index) / count if count else math.nan,
            "abs_logp_max": float(self.bins[2, index]) if count else math.nan,
            "large": int(self.bins[1, index]),
        }


def metrics(totals: Totals) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` over a pair's totals (only the counts where no
    token was scored)."""
    if not totals.tokens:
        return {m.name: (0.0 if m.name in ("tokens", "sequences") else None) for m in METRICS}
    return {m.name: m.compute(totals) for m in METRICS}


def first_argmax_divergence(argmax_differs: list[list[int]]) -> int | None:
    """The first position whose scorer argmax is not the sampled token (``[position,
    argmax]`` pairs, as :class:`~kvreplay.core.rollout.Scored` records them); None when
    the scorer would have decoded every token the sampler took. Meaningful at
    temperature 0, where the sampler took its own argmax."""
    return min((int(p) for p, _ in argmax_differs), default=None)


TOLERANCE_ULPS = 8
"""Where a chain's log-probabilities are not all float32 values, its terms add up to the
total within this many units in the last place of the largest log-probability
magnitude (each difference of two float64 values rounds once)."""


def float32_exact(values: np.ndarray) -> bool:
    """Whether every value is a float32 (whose differences in binary64 are exact)."""
    return bool(np.array_equal(values.astype(np.float32).astype(np.float64), values))


class ChainTally:
    """The decomposition along a chain of sides ``(lp_0, ..., lp_k)`` of the same
    tokens: term i is ``lp_i - lp_(i-1)``, the total ``lp_k - lp_0``. In binary64 the
    difference of two float32 log-probabilities is exact, so their terms add up to the
    total token for token (checked); log-probabilities that are not float32 (float64,
    or rounded decimals) add up within :data:`TOLERANCE_ULPS` (checked, and the claims
    say so: ``exact`` false). Per term and the total: exact sums of the signed and
    absolute values, per sequence too, the largest magnitude and the tokens it moved;
    fed a sequence at a time, a block of tokens held at most."""

    def __init__(self, terms: int):
        self.width = terms + 1  # the terms, then the total
        self.sums = Sums(2 * self.width)
        self.seq = [array("d") for _ in range(2 * self.width + 1)]
        self.maxima = [0.0] * self.width
        self.moved = [0] * self.width
        self.tokens = 0
        self.exact = True
        self.block: list[tuple[str, list[np.ndarray]]] = []
        self.pending = 0

    def add(self, sides: list[np.ndarray], key: str = "") -> None:
        """One sequence's kept tokens on every side of the chain, in chain order."""
        if not sides[0].size:
            return
        self.block.append((key, sides))
        self.pending += sides[0].size
        if self.pending >= BLOCK_TOKENS:
            self._flush()

    def _flush(self) -> None:
        block, self.block, self.pending = self.block, [], 0
        if not block:
            return
        counts = np.array([sides[0].size for _, sides in block])
        sides = [np.concatenate([s[i] for _, s in block]) for i in range(self.width)]
        terms = [after - before for before, after in zip(sides, sides[1:], strict=False)]
        total = sides[-1] - sides[0]
        summed = np.sum(np.stack(terms), axis=0)
        if all(float32_exact(side) for side in sides):
            bad = np.flatnonzero(summed != total)
        else:
            self.exact = False
            scale = np.max(np.abs(np.stack(sides)), axis=0)
            bad = np.flatnonzero(np.abs(summed - total) > TOLERANCE_ULPS * np.spacing(scale))
        if bad.size:
            starts = np.cumsum(counts) - counts
            which = int(np.searchsorted(starts, bad[0], side="right")) - 1
            raise KvreplayError(
                f"The decomposition's terms do not add up to the total in {block[which][0]} at "
                f"its kept token {int(bad[0] - starts[which])}."
            )
        values = [*terms, total]
        n = total.size
        self.sums.add(np.stack([*values, *map(np.abs, values)]))
        seq = np.repeat(np.arange(counts.size), counts)
        for i, v in enumerate(values):
            self.seq[i].frombytes(np.bincount(seq, weights=v, minlength=counts.size).tobytes())
            self.seq[self.width + i].frombytes(
                np.bincount(seq, weights=np.abs(v), minlength=counts.size).tobytes()
            )
            self.maxima[i] = max(self.maxima[i], float(np.max(np.abs(v))))
            self.moved[i] += int(np.count_nonzero(v))
        self.seq[-1].frombytes(counts.astype(np.float64).tobytes())
        self.tokens += n

    def finish(self) -> ChainTally:
        self._flush()
        return self

    def summary(self, index: int, stream: int) -> dict[str, Any]:
        """One term's (the total: ``index`` -1) per-token mean, signed and absolute,
        with 95% intervals over resampled sequences, its largest magnitude and how many
        tokens it moved."""
        i = index % self.width
        tokens = np.array(self.seq[-1])
        signed = mean_interval(np.array(self.seq[i]), tokens, stream)
        absolute = mean_interval(np.array(self.seq[self.width + i]), tokens, stream)
        return {
            "mean": self.sums.value(i) / self.tokens,
            "ci95": None if signed is None else [signed.low, signed.high],
            "abs_mean": self.sums.value(self.width + i) / self.tokens,
            "abs_ci95": None if absolute is None else [absolute.low, absolute.high],
            "max_abs": self.maxima[i],
            "tokens_moved": self.moved[i],
        }

    def gap(self, first: int, second: int, stream: int) -> tuple[float, Interval | None]:
        """How much more the term ``first`` moves log-probabilities than ``second`` (the
        mean of |first| - |second| per token), with its paired interval."""
        a, b = self.width + first, self.width + second
        difference = (self.sums.value(a) - self.sums.value(b)) / self.tokens
        per_sequence = np.array(self.seq[a]) - np.array(self.seq[b])
        return difference, mean_interval(per_sequence, np.array(self.seq[-1]), stream)

    @property
    def sequences(self) -> int:
        return len(self.seq[-1])


TREND_STEPS = 4  # the fewest steps whose k3 KL can rise at p <= 0.05 (1 in 24 orderings)
TREND_LEVEL = 0.05
EXACT_STEPS = 60  # up to here the p-value is exact (inversion counts), beyond normal


def _inversions(n: int) -> list[int]:
    """How many of the n! orderings of n values have k inversions, for every k."""
    counts = [1]
    for size in range(2, n + 1):
        prefix = [0, *np.cumsum(counts).tolist()]
        width = len(counts) + size - 1
        counts = [
            prefix[min(k + 1, len(counts))] - prefix[max(0, k - size + 1)] for k in range(width)
        ]
    return counts


def trend(steps: list[int], values: list[float]) -> dict[str, Any]:
    """Does the mismatch grow step over step? The Mann-Kendall test of ``values`` in step
    order: S, the pairs that rise less those that fall; Kendall's tau; the one-sided
    p-value of a rise as large by chance (exact up to :data:`EXACT_STEPS` steps: every
    ordering equally likely, ties counted as neither); Sen's slope per step; and the
    alarm, raised when at least :data:`TREND_STEPS` steps rise at p <= 0.05."""
    n = len(values)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    s = sum((values[j] > values[i]) - (values[j] < values[i]) for i, j in pairs)
    found: dict[str, Any] = {"steps": n, "s": s, "tau": s / len(pairs) if pairs else None}
    if n < 2:
        return found | {"p_value": None, "slope_per_step": None, "alarm": False}
    total = len(pairs)
    if n <= EXACT_STEPS:
        counts = _inversions(n)  # S = total - 2 * inversions
        extreme = sum(c for k, c in enumerate(counts) if total - 2 * k >= s)
        p = extreme / math.factorial(n)
    else:
        spread = math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
        p = 0.5 * math.erfc((s - 1) / spread / math.sqrt(2)) if s > 0 else 1.0
    slopes = [(values[j] - values[i]) / (steps[j] - steps[i]) for i, j in pairs]
    return found | {
        "p_value": p,
        "slope_per_step": float(np.median(slopes)),
        "first": values[0],
        "last": values[-1],
        "alarm": n >= TREND_STEPS and s > 0 and p <= TREND_LEVEL,
    }
