"""The flip predictor: rank rows by how likely a rebuilt prefix changes their suffix.

Beyond the paper. A suffix can only change where the rebuilt state's logits move
enough to swap the greedy argmax, and the live trajectory already records how
close every step came to that: its top-1 minus top-2 logit margin. A risk score
built from those margins alone is known before any prefill is built, so an
auditor can spend a prefill budget on the riskiest rows first.

The label is suffix divergence (the matrix ledger's ``suffix_equal`` is false).
The margins are those of the left arm's suffix in rows.jsonl: the live arm of
``matched`` rows, and the replay arm of ``fixed-prefix`` rows (bit-exact with live,
so it is the live trajectory too). Scores, window and threshold are fixed here
in advance and every one of them is reported; none is tuned on a run's data. Which
rows and margins a run gives it is the flip section's (``analysis/sections/flip.py``).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from kvreplay.core.claims import key
from kvreplay.measure.stats import (
    BOOTSTRAP_REPLICATES,
    BOOTSTRAP_SEED,
    BootstrapInterval,
    mann_whitney_auc,
    row_bootstrap_ci,
)

DEFAULT_WINDOW = 32
"""Decoded suffix steps a windowed score reads: an early, fixed budget that does not
grow with a plan's token caps, so scores compare across runs."""
DEFAULT_THRESHOLD = 0.5
"""Logits. BF16 logits of magnitude 16-32 are spaced 0.125 apart, so a margin of at
most 4 such steps is within reach of the rounding drift a one-shot prefill adds."""
AUDIT_SHARE = 0.2
"""The audit budget: the riskiest ceil(20% of n) rows are rebuilt and checked."""
FLIP_STREAM_BASE = 400
"""Bootstrap streams 400 + 10 * section + precision; the matrix section uses 0-123."""


@dataclass(frozen=True)
class RiskScore:
    """One member of the score family; higher means riskier.

    With no threshold the score is minus the smallest margin (one near-tie is
    enough to flip); with a threshold it counts margins at or under it (many
    near-ties give many chances). ``window`` None reads the whole suffix.
    """

    name: str
    window: int | None
    threshold: float | None = None

    def __call__(self, margins: Sequence[float]) -> float:
        steps = margins[: self.window]
        if self.threshold is None:
            return -min(steps) if steps else -math.inf  # no decoded step: nothing can flip
        return float(sum(1 for margin in steps if margin <= self.threshold))

    @property
    def description(self) -> str:
        where = f"the first {self.window} decoded suffix steps" if self.window else "the suffix"
        if self.threshold is None:
            return f"minus the smallest top-1/top-2 margin over {where}"
        return f"steps with margin <= {self.threshold:g} over {where}"


SCORES = (
    RiskScore(f"min_margin_k{DEFAULT_WINDOW}", DEFAULT_WINDOW),
    RiskScore(
        f"low_margin_count_k{DEFAULT_WINDOW}_t{DEFAULT_THRESHOLD:g}",
        DEFAULT_WINDOW,
        DEFAULT_THRESHOLD,
    ),
    RiskScore("min_margin_whole_suffix", None),
)
PRIMARY_SCORE = SCORES[0].name
"""Named before any run was scored; the others are reported beside it, never instead."""


def row_risks(margins: Sequence[float], scores: Sequence[RiskScore] = SCORES) -> array[float]:
    """One row's risk under every score: all the predictor keeps of a row (a few doubles,
    whatever its suffix's length)."""
    return array("d", (score(margins) for score in scores))


def risk_table(
    margins: Sequence[Sequence[float]], scores: Sequence[RiskScore] = SCORES
) -> np.ndarray:
    """Every row's risks (a row per row, a column per score)."""
    return np.array([row_risks(m, scores) for m in margins], dtype=np.float64).reshape(
        len(margins), len(scores)
    )


def audit_order(risks: np.ndarray, ties: ArrayLike) -> np.ndarray:
    """Row positions, riskiest first; equal risks in ascending row id (``ties``: the
    rows' ids, or their :func:`id_ranks`), so the audit set does not depend on the order
    in which workers appended rows."""
    return np.lexsort((np.asarray(ties), -np.asarray(risks, dtype=np.float64)))


def id_ranks(row_ids: np.ndarray) -> np.ndarray:
    """Each row's place in ascending row id: what the audit breaks ties by, in four
    bytes a row where an id takes sixteen."""
    ranks = np.empty(len(row_ids), dtype=np.int32)
    ranks[np.argsort(row_ids, kind="stable")] = np.arange(len(row_ids), dtype=np.int32)
    return ranks


def audited_rows(n: int, share: float = AUDIT_SHARE) -> int:
    """ceil(share * n), at least one row when there are any."""
    return min(n, max(1, math.ceil(share * n - 1e-9))) if n else 0


@dataclass(frozen=True)
class AuditCatch:
    """What auditing the riskiest rows finds, with the yardsticks to read it by.

    ``expected_if_ties_random`` is the catch averaged over every order of the rows
    tied at the cut: when many rows share a risk (BF16 margins are often exactly
    0), the row-id tie-break decides who is audited, and this says how much.
    """

    rows: int
    audited: int
    divergent: int
    caught: int
    tied_at_cut: int
    expected_if_ties_random: float

    @property
    def share(self) -> float | None:
        return self.caught / self.divergent if self.divergent else None

    def claims(self, interval: BootstrapInterval | None) -> AuditShare:
        """The catch as claims.json holds it, shares of the divergent rows."""
        share = (lambda count: count / self.divergent) if self.divergent else (lambda _: None)
        return AuditShare(
            audited_rows=self.audited,
            divergent_caught=self.caught,
            share_of_divergent=self.share,
            rows_tied_at_cut=self.tied_at_cut,
            share_expected_if_ties_random=share(self.expected_if_ties_random),
            share_best_possible=share(min(self.audited, self.divergent)),
            share_expected_random_audit=self.audited / self.rows if self.divergent else None,
            bootstrap_95_ci=_interval(interval),
        )


@dataclass(frozen=True)
class AuditShare:
    """Auditing the riskiest rows: how many, the divergent ones caught and the share of
    all divergent rows, the rows tied at the cut, the yardsticks (ties in random order,
    the best possible audit, a random audit), and the share's bootstrap interval."""

    audited_rows: int
    divergent_caught: int
    share_of_divergent: float | None
    rows_tied_at_cut: int
    share_expected_if_ties_random: float | None
    share_best_possible: float | None
    share_expected_random_audit: float | None
    bootstrap_95_ci: tuple[float, float] | None


def audit_catch(
    risks: np.ndarray, order: np.ndarray, labels: np.ndarray, audited: int
) -> AuditCatch:
    """Divergent rows among the first ``audited`` rows of ``order``."""
    caught = int(np.count_nonzero(labels[order[:audited]]))
    if not audited:
        return AuditCatch(0, 0, 0, 0, 0, 0.0)
    cut = risks[order[audited - 1]]
    above, tied = risks > cut, risks == cut
    slots = audited - int(np.count_nonzero(above))
    expected = np.count_nonzero(labels & above) + slots * np.count_nonzero(
        labels & tied
    ) / np.count_nonzero(tied)
    return AuditCatch(
        len(risks),
        audited,
        int(np.count_nonzero(labels)),
        caught,
        int(np.count_nonzero(tied)),
        float(expected),
    )


def auc_resampler(risks: np.ndarray, labels: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """:func:`resampled_auc` of these rows for any index matrix, the rows grouped by
    their distinct risks once (not once a block)."""
    values, which = np.unique(risks, return_inverse=True)
    order = np.argsort(which, kind="stable")
    starts = np.searchsorted(which[order], np.arange(values.size))
    positive = labels[order]  # a flag a row (not a double): counts times it are counts
    negative = ~positive
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)

    def resampled(indices: np.ndarray) -> np.ndarray:
        block, n = indices.shape
        cells = (rank[indices] + n * np.arange(block)[:, None]).ravel()
        counts = np.bincount(cells, minlength=block * n).reshape(block, n)
        at_pos = np.add.reduceat(counts * positive, starts, axis=1)
        at_neg = np.add.reduceat(counts * negative, starts, axis=1)
        below_neg = np.cumsum(at_neg, axis=1) - at_neg
        wins = (at_pos * (below_neg + 0.5 * at_neg)).sum(axis=1)
        pairs = at_pos.sum(axis=1) * at_neg.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(pairs > 0, wins / pairs, np.nan)

    return resampled


def resampled_auc(risks: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Mann-Whitney AUC of each resample in a (block, n) index matrix, NaN where a class is empty.

    A resample is row multiplicities c. With the rows grouped by their distinct risk
    values, its AUC is the sum over values of (positives' weight at the value) x
    (negatives' weight below it + half their weight at it), over the product of the
    classes' weights: time and memory grow with block x n, not with positives x
    negatives. Every term is a whole or half count, so the sums are exact, whatever
    their order.
    """
    return auc_resampler(risks, labels)(indices)


def catch_resampler(
    order: np.ndarray, labels: np.ndarray, audited: int
) -> Callable[[np.ndarray], np.ndarray]:
    """:func:`resampled_catch_share` of these rows for any index matrix, each row's
    rank in ``order`` taken once (not once a block)."""
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    label_at_rank = labels[order]

    def resampled(indices: np.ndarray) -> np.ndarray:
        caught = label_at_rank[np.sort(rank[indices], axis=1)[:, :audited]].sum(axis=1)
        total = labels[indices].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, caught / np.maximum(total, 1), np.nan)

    return resampled


def resampled_catch_share(
    order: np.ndarray, labels: np.ndarray, audited: int, indices: np.ndarray
) -> np.ndarray:
    """Top-audited catch share of each resample, ties broken as in the point estimate.

    Rows keep their rank in ``order``; copies of one row are adjacent and share a
    label, so sorting the resample's ranks reproduces the audit set exactly.
    """
    return catch_resampler(order, labels, audited)(indices)


def roc_points(risks: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rate, true positive rate) at every distinct threshold, from (0, 0).

    Tied risks move both rates at once (a diagonal step), so the trapezoid area
    under these points equals the Mann-Whitney AUC with ties counted half.
    """
    thresholds = np.unique(risks)[::-1]
    positive = max(1, int(np.count_nonzero(labels)))
    negative = max(1, int(np.count_nonzero(~labels)))
    tp = np.array([np.count_nonzero(labels & (risks >= t)) for t in thresholds])
    fp = np.array([np.count_nonzero(~labels & (risks >= t)) for t in thresholds])
    return np.concatenate([[0.0], fp / negative]), np.concatenate([[0.0], tp / positive])


def _interval(interval: BootstrapInterval | None) -> tuple[float, float] | None:
    return (interval.low, interval.high) if interval else None


@dataclass(frozen=True)
class ScoreClaims:
    """One score on one panel: its AUC with the bootstrap interval and the resamples it
    was defined on, and the audit of the riskiest rows."""

    auc: float | None
    auc_bootstrap_95_ci: tuple[float, float] | None
    auc_bootstrap_defined_replicates: int
    audit_top_share: AuditShare


@dataclass(frozen=True, eq=False)
class ScoreResult:
    """One score on one (section, precision) panel: AUC and the audit catch."""

    score: RiskScore
    auc: float | None
    auc_ci: BootstrapInterval | None
    catch: AuditCatch
    catch_ci: BootstrapInterval | None

    def claims(self) -> ScoreClaims:
        return ScoreClaims(
            auc=self.auc,
            auc_bootstrap_95_ci=_interval(self.auc_ci),
            auc_bootstrap_defined_replicates=self.auc_ci.defined_replicates if self.auc_ci else 0,
            audit_top_share=self.catch.claims(self.catch_ci),
        )


@dataclass(frozen=True)
class PanelClaims:
    """The predictor on one precision of one matrix section."""

    rows: int
    divergent_rows: int
    exact_rows: int
    auc_status: str
    bootstrap_stream: int
    scores: dict[str, ScoreClaims]

    @property
    def defined(self) -> bool:
        return self.auc_status == "defined"


@dataclass(frozen=True, eq=False)
class FlipPanel:
    """The predictor on one precision of one matrix section."""

    section: str
    precision: str
    rows: int
    labels: np.ndarray
    stream: int
    results: tuple[ScoreResult, ...]

    @property
    def divergent(self) -> int:
        return int(np.count_nonzero(self.labels))

    @property
    def undefined(self) -> str | None:
        """Why the AUC is undefined on this panel, or None."""
        if not self.divergent:
            return "no row diverges, so there is nothing to predict"
        if self.divergent == self.rows:
            return "every row diverges, so there is no exact row to rank below"
        return None

    def claims(self) -> PanelClaims:
        return PanelClaims(
            rows=self.rows,
            divergent_rows=self.divergent,
            exact_rows=self.rows - self.divergent,
            auc_status=f"undefined: {self.undefined}" if self.undefined else "defined",
            bootstrap_stream=self.stream,
            scores={r.score.name: r.claims() for r in self.results},
        )


@dataclass(frozen=True)
class ScoreSpec:
    """A score as claims.json describes it."""

    description: str
    window: int | None
    threshold: float | None


@dataclass(frozen=True)
class Bootstrap:
    seed: int
    replicates: int


@dataclass(frozen=True)
class FlipMethod:
    """What the predictor's numbers mean: its label, its scores (the primary first named),
    the audit's share and tie-break, and the bootstrap."""

    label: str
    primary_score: str
    scores: dict[str, ScoreSpec]
    audit_share: float
    audit_tie_break: str
    bootstrap: Bootstrap


@dataclass(frozen=True)
class FlipPredictor:
    """The predictor's part of claims.json: why it did not run (``note``), or its method
    and each matrix section's panels, by section and precision."""

    note: str | None = field(default=None, metadata=key(omit=True))
    method: FlipMethod | None = field(default=None, metadata=key(flatten=True, omit=True))
    panels: dict[str, dict[str, PanelClaims]] = field(
        default_factory=dict, metadata=key(flatten=True)
    )


@dataclass(frozen=True)
class FlipAnalysis:
    """Every panel of a run, or the plain reason the predictor could not run."""

    panels: tuple[FlipPanel, ...] = ()
    skipped: str | None = None
    scores: tuple[RiskScore, ...] = field(default=SCORES)

    def claims(self) -> FlipPredictor:
        if self.skipped:
            return FlipPredictor(note=self.skipped)
        method = FlipMethod(
            label="suffix divergence (suffix_equal is false)",
            primary_score=PRIMARY_SCORE,
            scores={s.name: ScoreSpec(s.description, s.window, s.threshold) for s in self.scores},
            audit_share=AUDIT_SHARE,
            audit_tie_break="equal risk: ascending row_id",
            bootstrap=Bootstrap(BOOTSTRAP_SEED, BOOTSTRAP_REPLICATES),
        )
        panels: dict[str, dict[str, PanelClaims]] = {}
        for panel in self.panels:
            panels.setdefault(panel.section, {})[panel.precision] = panel.claims()
        return FlipPredictor(method=method, panels=panels)


def score_panel(
    section: str,
    precision: str,
    ties: ArrayLike,
    risks_by_score: np.ndarray,
    labels: np.ndarray,
    stream: int,
    scores: Sequence[RiskScore] = SCORES,
) -> FlipPanel:
    """Every score's AUC and audit catch, each with a row bootstrap on one shared stream
    (so scores are compared on the same resamples); ``risks_by_score`` holds each row's
    risks, a column per score (:func:`risk_table`), ``ties`` what equal risks are
    audited by (:func:`audit_order`)."""
    labels = np.asarray(labels, dtype=bool)
    ties = np.asarray(ties)
    n = len(ties)
    audited = audited_rows(n)
    results = []
    for column, score in enumerate(scores):
        risks = np.ascontiguousarray(risks_by_score[:, column])
        order = audit_order(risks, ties)
        auc = mann_whitney_auc(risks, labels)
        catch = audit_catch(risks, order, labels, audited)
        auc_ci = (
            row_bootstrap_ci(auc_resampler(risks, labels), n, stream) if auc is not None else None
        )
        catch_ci = (
            row_bootstrap_ci(catch_resampler(order, labels, audited), n, stream)
            if catch.share is not None
            else None
        )
        results.append(ScoreResult(score, auc, auc_ci, catch, catch_ci))
    return FlipPanel(section, precision, n, labels, stream, tuple(results))
