"""The training-inference mismatch (design: mismatch), each metric defined once, here, as
RL frameworks log it: pure numpy, deterministic, so a claims file re-derives bit for bit.

A *pair* is two sides' log-probabilities of the same sampled tokens, sequence by
sequence: the rollout side (what the sampler reported while it decoded) and the scorer
side (a teacher-forced prefill of the same ids). Per token,

    delta = log p_scorer - log p_rollout,   ratio = exp(delta) = p_scorer / p_rollout,

so delta > 0 where the trainer finds a token likelier than the sampler did. Every metric
of :data:`METRICS` is a function of the pairs alone; its ``known_as`` names what verl,
TRL and prime-rl log under the same definition. The *decomposition* of a total delta
into terms that add up exactly lives here too (:func:`decompose`), with paired bootstrap
intervals that resample whole sequences (:func:`term_interval`), since a sequence's
tokens are not independent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvreplay.measure.stats import BootstrapInterval, row_bootstrap_ci

DEFAULT_CAP = 2.0
"""The importance-ratio cap of truncated and masked importance sampling (TIS, MIS): a
token whose ratio exceeds it is truncated (or, outside [1/cap, cap], masked)."""

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
POSITION_BINS = 8  # where along the sequence: eighths of its length
MARGIN_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, 4.0, math.inf)
"""Bins of the scorer's top-1/top-2 log-probability gap at a token (nats)."""


@dataclass(frozen=True)
class Pairs:
    """Two sides' log-probabilities of the same tokens, flattened in sequence order, with
    each token's sequence, its position in it, that sequence's length, and the scorer's
    top-1/top-2 gap there (NaN where not known)."""

    rollout: np.ndarray
    scorer: np.ndarray
    sequence: np.ndarray
    position: np.ndarray
    length: np.ndarray
    margin: np.ndarray

    @classmethod
    def of(
        cls,
        rollout: Sequence[Sequence[float]],
        scorer: Sequence[Sequence[float]],
        margins: Sequence[Sequence[float] | None] | None = None,
    ) -> Pairs:
        """Pairs from per-sequence lists; each sequence's sides must have equal lengths."""
        if len(rollout) != len(scorer):
            raise ValueError("both sides need the same number of sequences")
        lengths = [len(r) for r in rollout]
        if any(len(s) != n for s, n in zip(scorer, lengths, strict=True)):
            raise ValueError("a sequence's two sides hold different numbers of tokens")
        gaps = [
            np.asarray(m, dtype=np.float64) if m is not None else np.full(n, np.nan)
            for m, n in zip(margins or [None] * len(lengths), lengths, strict=True)
        ]
        return cls(
            rollout=_flat(rollout),
            scorer=_flat(scorer),
            sequence=np.repeat(np.arange(len(lengths)), lengths),
            position=np.concatenate([np.arange(n) for n in lengths] or [np.zeros(0, int)]),
            length=np.repeat(np.asarray(lengths, dtype=np.int64), lengths),
            margin=np.concatenate(gaps) if gaps else np.zeros(0),
        )

    @property
    def delta(self) -> np.ndarray:
        """log p_scorer - log p_rollout, per token (exact in binary64 for fp32 inputs)."""
        return self.scorer - self.rollout

    @property
    def sequences(self) -> int:
        return int(self.sequence.max()) + 1 if self.sequence.size else 0

    def __len__(self) -> int:
        return int(self.rollout.shape[0])


def _flat(sequences: Sequence[Sequence[float]]) -> np.ndarray:
    parts = [np.asarray(s, dtype=np.float64) for s in sequences]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass(frozen=True)
class Metric:
    """One metric: its name in kvreplay's tables, its definition (as the docs give it),
    what RL frameworks call it, and how it is computed from the pairs and the cap."""

    name: str
    definition: str
    known_as: str
    compute: Callable[[Pairs, float], float | None]


def _ratio(pairs: Pairs) -> np.ndarray:
    return np.exp(pairs.delta)


def _seq_log_ratio(pairs: Pairs) -> np.ndarray:
    return np.bincount(pairs.sequence, weights=pairs.delta, minlength=pairs.sequences)


def _seq_mean(pairs: Pairs, values: np.ndarray) -> np.ndarray:
    """Each sequence's mean of a per-token value."""
    sums = np.bincount(pairs.sequence, weights=values, minlength=pairs.sequences)
    return sums / np.bincount(pairs.sequence, minlength=pairs.sequences)


def _std(values: np.ndarray) -> float | None:
    return float(np.std(values, ddof=1)) if values.size > 1 else None


def _pearson(left: np.ndarray, right: np.ndarray) -> float | None:
    """Pearson's r; None where either side is constant (r is undefined)."""
    if left.size < 2 or np.ptp(left) == 0 or np.ptp(right) == 0:
        return None
    return float(np.corrcoef(left, right)[0, 1])


def _quantile(q: float) -> Callable[[Pairs, float], float]:
    return lambda p, cap: float(np.quantile(_ratio(p), q))


def _mean(values: np.ndarray) -> float:
    return math.fsum(values.tolist()) / values.size


METRICS: tuple[Metric, ...] = (
    Metric("tokens", "scored tokens", "", lambda p, cap: float(len(p))),
    Metric("sequences", "scored sequences", "", lambda p, cap: float(p.sequences)),
    Metric(
        "logp_diff_mean",
        "mean of delta (signed): above 0 the scorer finds the sampled tokens likelier",
        "",
        lambda p, cap: _mean(p.delta),
    ),
    Metric(
        "abs_logp_mean",
        "mean of |delta|",
        "TRL sampling/sampling_logp_difference/mean",
        lambda p, cap: _mean(np.abs(p.delta)),
    ),
    Metric(
        "abs_logp_max",
        "largest |delta|",
        "TRL sampling/sampling_logp_difference/max",
        lambda p, cap: float(np.max(np.abs(p.delta))),
    ),
    Metric(
        "probs_diff_mean",
        "mean of |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_mean",
        lambda p, cap: _mean(np.abs(np.exp(p.scorer) - np.exp(p.rollout))),
    ),
    Metric(
        "probs_diff_max",
        "largest |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_max",
        lambda p, cap: float(np.max(np.abs(np.exp(p.scorer) - np.exp(p.rollout)))),
    ),
    Metric(
        "probs_diff_std",
        "sample standard deviation (n - 1) of |p_scorer - p_rollout|",
        "verl training/rollout_probs_diff_std",
        lambda p, cap: _std(np.abs(np.exp(p.scorer) - np.exp(p.rollout))),
    ),
    Metric(
        "probs_pearson",
        "Pearson correlation of p_rollout and p_scorer over tokens (empty where one side "
        "is constant)",
        "verl training/rollout_actor_probs_pearson_corr",
        lambda p, cap: _pearson(np.exp(p.rollout), np.exp(p.scorer)),
    ),
    Metric(
        "kl_k1",
        "mean of -delta: the k1 estimator of KL(rollout || scorer) from the sampled tokens",
        "verl rollout_corr/kl",
        lambda p, cap: _mean(-p.delta),
    ),
    Metric(
        "kl_k3",
        "mean of ratio - 1 - delta: the k3 estimator of KL(rollout || scorer), never below 0",
        "verl rollout_corr/k3_kl",
        lambda p, cap: _mean(np.expm1(p.delta) - p.delta),
    ),
    Metric(
        "seq_log_ratio_mean",
        "mean over sequences of the sum of delta (the log of the sequence importance ratio)",
        "",
        lambda p, cap: _mean(_seq_log_ratio(p)),
    ),
    Metric(
        "seq_log_ratio_abs_max",
        "largest |sum of delta| of a sequence",
        "",
        lambda p, cap: float(np.max(np.abs(_seq_log_ratio(p)))),
    ),
    *(
        Metric(
            f"ratio_q{round(q * 100):02d}",
            f"the {q:g} quantile of the token importance ratio exp(delta)",
            "",
            _quantile(q),
        )
        for q in QUANTILES
    ),
    Metric(
        "ratio_above_cap",
        "share of tokens whose ratio exceeds the cap (what truncated IS truncates)",
        "TIS truncation share",
        lambda p, cap: _mean((_ratio(p) > cap).astype(np.float64)),
    ),
    Metric(
        "ratio_outside_cap",
        "share of tokens whose ratio lies outside [1/cap, cap] (what masked IS masks)",
        "verl rollout_rs_masked_fraction (token)",
        lambda p, cap: _mean(((_ratio(p) > cap) | (_ratio(p) < 1 / cap)).astype(np.float64)),
    ),
    Metric(
        "ppl_rollout",
        "mean over sequences of exp(-mean log p_rollout): each sequence's perplexity, averaged",
        "verl rollout_corr/rollout_ppl",
        lambda p, cap: _mean(np.exp(-_seq_mean(p, p.rollout))),
    ),
    Metric(
        "ppl_scorer",
        "mean over sequences of exp(-mean log p_scorer)",
        "verl rollout_corr/training_ppl",
        lambda p, cap: _mean(np.exp(-_seq_mean(p, p.scorer))),
    ),
    Metric(
        "chi2_token",
        "mean of ratio**2, less 1: the token-level chi-squared divergence",
        "verl rollout_corr/chi2_token (verl clamps delta to [-20, 20] first)",
        lambda p, cap: _mean(np.exp(2 * p.delta)) - 1,
    ),
    Metric(
        "tokens_bit_equal",
        "share of tokens whose two log-probabilities are the same float (delta exactly 0)",
        "",
        lambda p, cap: _mean((p.delta == 0).astype(np.float64)),
    ),
)
METRIC_NAMES = tuple(m.name for m in METRICS)


def metrics(pairs: Pairs, cap: float = DEFAULT_CAP) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` over the pairs (None: undefined on them)."""
    if not len(pairs):
        raise ValueError("the mismatch needs at least one scored token")
    return {m.name: m.compute(pairs, cap) for m in METRICS}


def large(pairs: Pairs, cap: float = DEFAULT_CAP) -> np.ndarray:
    """Tokens whose ratio lies outside [1/cap, cap]: the differences RL corrections act on."""
    return np.abs(pairs.delta) > math.log(cap)


def by_position(pairs: Pairs, cap: float = DEFAULT_CAP) -> list[dict[str, float | int]]:
    """Where along the sequence the differences sit: per eighth of each sequence's
    length, its tokens, their mean |delta| and how many are large."""
    where = np.minimum(pairs.position * POSITION_BINS // np.maximum(pairs.length, 1), 7)
    return _binned(pairs, where, POSITION_BINS, cap, "eighth")


def by_margin(pairs: Pairs, cap: float = DEFAULT_CAP) -> list[dict[str, float | int]]:
    """At what top-1/top-2 gap (the scorer's) the differences sit: per bin of
    :data:`MARGIN_EDGES` (the last one open: ``margin_to`` None), its tokens, their mean
    |delta| and how many are large."""
    known = ~np.isnan(pairs.margin)
    where = np.full(len(pairs), -1)
    where[known] = np.searchsorted(MARGIN_EDGES, pairs.margin[known], side="right") - 1
    rows = _binned(pairs, where, len(MARGIN_EDGES) - 1, cap, "bin")
    for row in rows:
        index = int(row.pop("bin"))
        upper = MARGIN_EDGES[index + 1]
        row["margin_from"], row["margin_to"] = (
            MARGIN_EDGES[index],
            upper if upper < math.inf else None,
        )
    return rows


def _binned(
    pairs: Pairs, where: np.ndarray, bins: int, cap: float, key: str
) -> list[dict[str, float | int]]:
    magnitude, flagged = np.abs(pairs.delta), large(pairs, cap)
    rows: list[dict[str, float | int]] = []
    for index in range(bins):
        mask = where == index
        count = int(mask.sum())
        rows.append(
            {
                key: index,
                "tokens": count,
                "abs_logp_mean": _mean(magnitude[mask]) if count else math.nan,
                "abs_logp_max": float(magnitude[mask].max()) if count else math.nan,
                "large": int(flagged[mask].sum()),
            }
        )
    return rows


def first_argmax_divergence(argmax_differs: Sequence[Sequence[int]]) -> int | None:
    """The first position whose scorer argmax is not the sampled token (``[position,
    argmax]`` pairs, as :class:`~kvreplay.core.rollout.Scored` records them); None when
    the scorer would have decoded every token the sampler took. Meaningful at
    temperature 0, where the sampler took its own argmax."""
    return min((int(p) for p, _ in argmax_differs), default=None)


@dataclass(frozen=True)
class Decomposition:
    """A total delta split into named terms that add up to it, token for token:
    ``sum(terms) == total`` holds exactly (checked) for every token."""

    names: tuple[str, ...]
    terms: tuple[np.ndarray, ...]
    total: np.ndarray
    sequence: np.ndarray

    @property
    def sequences(self) -> int:
        return int(self.sequence.max()) + 1 if self.sequence.size else 0


def decompose(
    chain: Sequence[tuple[str, Sequence[Sequence[float]]]],
) -> Decomposition:
    """The chain's consecutive differences as terms: given sides ``(name_0, lp_0), ...,
    (name_k, lp_k)`` of the same tokens, term i is ``lp_i - lp_{i-1}`` (named
    ``name_i``) and the total ``lp_k - lp_0``. In binary64 the difference of two fp32
    log-probabilities is exact (when they lie within 2**29 of each other), so the terms
    add up to the total exactly; a token where they do not is refused."""
    sides = [_flat(lps) for _, lps in chain]
    lengths = [len(s) for s in chain[0][1]]
    terms = tuple(after - before for before, after in zip(sides, sides[1:], strict=False))
    total = sides[-1] - sides[0]
    summed = np.sum(np.stack(terms), axis=0) if terms else np.zeros_like(total)
    if not np.array_equal(summed, total):
        bad = int(np.flatnonzero(summed != total)[0])
        raise ValueError(f"the terms do not add up to the total at token {bad}")
    return Decomposition(
        tuple(name for name, _ in chain[1:]),
        terms,
        total,
        np.repeat(np.arange(len(lengths)), lengths),
    )


def term_interval(
    values: np.ndarray, sequence: np.ndarray, stream: int, absolute: bool = False
) -> BootstrapInterval | None:
    """95% percentile interval of a per-token mean (of ``|values|`` with ``absolute``)
    over resamples of whole sequences (the paper's bootstrap, ``stream`` fixing its
    draws, so every term of one decomposition is resampled alike: paired)."""
    x = np.abs(values) if absolute else values
    count = int(sequence.max()) + 1 if sequence.size else 0
    sums = np.bincount(sequence, weights=x, minlength=count)
    tokens = np.bincount(sequence, minlength=count).astype(np.float64)
    return row_bootstrap_ci(
        lambda index: sums[index].sum(axis=1) / tokens[index].sum(axis=1), count, stream
    )
