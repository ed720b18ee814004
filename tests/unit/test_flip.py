"""The flip predictor's statistics on hand-made rows (analysis/flip.py, measure/stats.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvreplay.analysis.flip import (
    SCORES,
    RiskScore,
    audit_catch,
    audit_order,
    audited_rows,
    resampled_auc,
    resampled_catch_share,
    risk_table,
    roc_points,
    score_panel,
)
from kvreplay.measure.stats import bootstrap_index_blocks, mann_whitney_auc, row_bootstrap_ci

LABELS = np.array([True, True, True, False, False, False, False])
RISKS = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0])


def test_auc_of_a_perfect_score_is_one_and_of_its_reverse_zero() -> None:
    assert mann_whitney_auc(RISKS, LABELS) == 1.0
    assert mann_whitney_auc(-RISKS, LABELS) == 0.0


def test_auc_of_a_constant_score_is_one_half() -> None:
    assert mann_whitney_auc(np.zeros(7), LABELS) == 0.5


def test_auc_counts_ties_half() -> None:
    # positives 2, 1; negatives 1, 0: pairs (2>1) (2>0) (1=1) (1>0) = 3 + 0.5 of 4
    assert mann_whitney_auc([2, 1, 1, 0], [True, True, False, False]) == pytest.approx(3.5 / 4)


@pytest.mark.parametrize("labels", [[True, True], [False, False], []])
def test_auc_is_undefined_without_both_classes(labels: list[bool]) -> None:
    assert mann_whitney_auc(np.arange(len(labels)), labels) is None


def test_roc_area_equals_the_mann_whitney_auc_with_ties() -> None:
    rng = np.random.default_rng(0)
    risks = rng.integers(0, 4, 40).astype(float)  # many ties
    labels = rng.random(40) < 0.4
    fpr, tpr = roc_points(risks, labels)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert area == pytest.approx(mann_whitney_auc(risks, labels))


def test_scores_read_the_window_and_threshold() -> None:
    margins = [3.0, 0.5, 2.0, 0.25, 0.0]
    assert RiskScore("m", window=3)(margins) == -0.5
    assert RiskScore("m", window=None)(margins) == 0.0
    assert RiskScore("c", window=4, threshold=0.5)(margins) == 2.0
    assert RiskScore("m", window=3)([]) == -math.inf  # nothing decoded: the safest row
    assert RiskScore("c", window=3, threshold=0.5)([]) == 0.0
    assert len({s.name for s in SCORES}) == len(SCORES)


def test_resampled_auc_on_the_identity_resample_is_the_point_estimate() -> None:
    rng = np.random.default_rng(1)
    risks = rng.integers(0, 5, 30).astype(float)
    labels = rng.random(30) < 0.5
    indices = np.vstack([np.arange(30), rng.integers(0, 30, 30), np.zeros(30, dtype=int)])
    values = resampled_auc(risks, labels, indices)
    assert values[0] == pytest.approx(mann_whitney_auc(risks, labels))
    assert values[1] == pytest.approx(mann_whitney_auc(risks[indices[1]], labels[indices[1]]))
    assert np.isnan(values[2])  # one row copied 30 times has one class only


def _pairwise_auc(risks: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> float:
    """The definition, pair by pair: a win is 1, a tie 1/2, over every positive and
    negative row of the resample (copies counted as often as drawn)."""
    pos, neg = risks[rows][labels[rows]], risks[rows][~labels[rows]]
    if not pos.size or not neg.size:
        return math.nan
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (pos.size * neg.size)


@pytest.mark.parametrize("seed", range(6))
def test_auc_without_a_pair_matrix_is_the_pairwise_definition_exactly(seed: int) -> None:
    """Grouping rows by their distinct risks (so no positives x negatives matrix is
    built, whatever the ledger's size) counts whole and half wins exactly: the
    resampled and the point AUC equal the pair-by-pair definition to the last bit."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    risks = np.round(rng.normal(size=n), int(rng.integers(0, 2)))  # many ties
    labels = rng.random(n) < rng.random()
    indices = rng.integers(0, n, size=(25, n))
    values = resampled_auc(risks, labels, indices)
    for value, rows in zip(values, indices, strict=True):
        expected = _pairwise_auc(risks, labels, rows)
        assert value == expected or (math.isnan(value) and math.isnan(expected))
    point = mann_whitney_auc(risks, labels)
    expected = _pairwise_auc(risks, labels, np.arange(n))
    assert point == expected or (point is None and math.isnan(expected))


def test_bootstrap_interval_holds_the_estimate_and_is_seeded() -> None:
    rng = np.random.default_rng(2)
    labels = rng.random(40) < 0.5
    risks = labels + rng.normal(0, 0.8, 40)
    auc = mann_whitney_auc(risks, labels)
    first = row_bootstrap_ci(lambda idx: resampled_auc(risks, labels, idx), 40, stream=7)
    again = row_bootstrap_ci(lambda idx: resampled_auc(risks, labels, idx), 40, stream=7)
    other = row_bootstrap_ci(lambda idx: resampled_auc(risks, labels, idx), 40, stream=8)
    assert first is not None and other is not None
    assert first.low <= auc <= first.high
    assert first == again
    assert first != other


def test_bootstrap_drops_undefined_resamples_and_gives_none_when_all_are() -> None:
    labels = np.array([True] + [False] * 9)  # one positive: some resamples miss it
    interval = row_bootstrap_ci(lambda idx: resampled_auc(np.arange(10.0), labels, idx), 10, 0)
    assert interval is not None
    assert 0 < interval.defined_replicates < sum(b.shape[0] for b in bootstrap_index_blocks(10, 0))
    assert row_bootstrap_ci(lambda idx: np.full(idx.shape[0], np.nan), 10, 0) is None
    assert row_bootstrap_ci(lambda idx: np.zeros(idx.shape[0]), 0, 0) is None


def test_audit_takes_ceil_twenty_percent() -> None:
    assert [audited_rows(n) for n in (0, 1, 4, 5, 24, 200)] == [0, 1, 1, 1, 5, 40]


def test_top_share_on_a_hand_made_example_breaks_ties_by_row_id() -> None:
    # ten rows, two audited; r03 and r01 tie at the top risk, r07 is next
    row_ids = [f"r{i:02d}" for i in range(10)]
    risks = np.array([0, 9, 0, 9, 0, 0, 0, 5, 0, 0], dtype=float)
    labels = np.zeros(10, dtype=bool)
    labels[[3, 7, 8]] = True
    order = audit_order(risks, row_ids)
    assert list(order[:3]) == [1, 3, 7]  # r01 before r03: equal risk, ascending row id
    catch = audit_catch(risks, order, labels, audited_rows(10))
    assert (catch.audited, catch.caught, catch.divergent) == (2, 1, 3)
    assert catch.share == pytest.approx(1 / 3)
    assert catch.tied_at_cut == 2
    assert catch.expected_if_ties_random == pytest.approx(1.0)
    # three audited: r07 is strictly above every unaudited row, no tie at the cut
    catch = audit_catch(risks, order, labels, 3)
    assert (catch.caught, catch.tied_at_cut, catch.expected_if_ties_random) == (2, 1, 2.0)


def test_ties_at_the_cut_average_over_their_orders() -> None:
    risks = np.zeros(5)
    labels = np.array([False, False, True, True, False])
    catch = audit_catch(risks, audit_order(risks, list("abcde")), labels, 2)
    assert catch.caught == 0  # rows a and b by row id
    assert catch.expected_if_ties_random == pytest.approx(2 * 2 / 5)


def test_resampled_catch_share_on_the_identity_resample_is_the_point_estimate() -> None:
    row_ids = [f"r{i}" for i in range(8)]
    risks = np.array([3, 3, 1, 0, 2, 2, 0, 1], dtype=float)
    labels = np.array([0, 1, 0, 1, 1, 0, 0, 0], dtype=bool)
    order = audit_order(risks, row_ids)
    catch = audit_catch(risks, order, labels, 2)
    values = resampled_catch_share(order, labels, 2, np.vstack([np.arange(8), np.zeros(8, int)]))
    assert values[0] == pytest.approx(catch.share)
    assert np.isnan(values[1])  # row r0 only: no divergent row


def test_panel_without_divergence_is_undefined_not_an_error() -> None:
    margins = [[1.0, 0.25], [2.0], [0.0, 3.0]]
    panel = score_panel(
        "s", "fp32", ["a", "b", "c"], risk_table(margins), np.zeros(3, bool), stream=0
    )
    assert panel.undefined is not None and "no row diverges" in panel.undefined
    block = panel.claims()
    assert block.auc_status.startswith("undefined") and not block.defined
    for result in block.scores.values():
        assert result.auc is None and result.auc_bootstrap_95_ci is None
        assert result.audit_top_share.share_of_divergent is None


def test_panel_where_every_row_diverges_has_no_auc_but_a_catch() -> None:
    panel = score_panel(
        "s", "bf16", ["a", "b"], risk_table([[0.0], [1.0]]), np.ones(2, bool), stream=0
    )
    assert panel.undefined is not None and "every row diverges" in panel.undefined
    result = panel.results[0]
    assert result.auc is None and result.catch.share == pytest.approx(1 / 2)


def test_panel_on_a_separable_example() -> None:
    # divergent rows hold a near-tie early; exact rows never come close
    margins = [[0.0, 4.0], [3.0, 0.125], [0.25, 6.0], [5.0, 7.0], [4.0, 9.0], [8.0, 2.0]]
    labels = np.array([True, True, True, False, False, False])
    panel = score_panel("s", "bf16", list("abcdef"), risk_table(margins), labels, stream=3)
    by_name = {r.score.name: r for r in panel.results}
    for name in ("min_margin_k32", "min_margin_whole_suffix", "low_margin_count_k32_t0.5"):
        result = by_name[name]
        assert result.auc == 1.0
        assert result.auc_ci is not None and result.auc_ci.high == 1.0
        assert result.catch.audited == 2 and result.catch.caught == 2


def test_risks_are_held_in_four_bytes_only_where_every_one_is_exact_in_four() -> None:
    from kvreplay.analysis.sections.flip import _narrowed

    exact = np.array([[-0.125, 3.0, -np.inf], [-2.5, 0.0, -4.75]], order="F")
    narrow = _narrowed(exact)
    assert narrow.dtype == np.float32 and np.array_equal(narrow, exact)
    assert np.ascontiguousarray(narrow[:, 0]).base is not None  # a score's column: a view
    inexact = np.array([[-0.1, 1.0]])  # 0.1 is not a float32
    assert _narrowed(inexact).dtype == np.float64
