"""The matrix section: ``matched`` and ``fixed-prefix`` ledgers (a served ``matched`` one
too) as the paper's claims, per precision and across precisions, computed as the paper's
published method specifies; their summary lines, headline rows beside the paper's
published figures, and report blocks (disagreement, accuracy, first divergence, drift by
layer)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvreplay.core.claims import key
from kvreplay.experiments.matrix.table import (
    FIXED_PREFIX_TABLE,
    LAYER_DRIFT,
    MATCHED_TABLE,
    SERVED_MATCHED_TABLE,
)
from kvreplay.harness.rows import replica_name
from kvreplay.harness.section import Page, Reading, Row, Section
from kvreplay.harness.table import Ledger, Table
from kvreplay.measure.rates import Rate, count, fraction, interval, median
from kvreplay.measure.stats import (
    MATRIX_WILSON_Z,
    mcnemar_exact_p,
    newcombe_paired_difference_ci,
    paired_bootstrap_ci_pp,
)
from kvreplay.render.document import Block, Heading, Image, Paragraph
from kvreplay.render.document import Table as Grid

PRECISION_STREAM_OFFSET = {"bf16": 0, "fp32": 1}
CROSS_PRECISION_STREAMS = {
    "suffix_mismatch": 20,
    "answer_mismatch": 21,
    "correctness_flip": 22,
    "logits_mismatch": 23,
}
ACCURACY_DIFFERENCE_STREAM = 30
NEWCOMBE_NOTE = (
    "Newcombe (1998) method 10 score interval for a paired difference of proportions"
    " (z = 1.96), in percentage points, beside the paper's paired percentile bootstrap."
)


@dataclass(frozen=True)
class MatrixDesign:
    """What distinguishes the matched and fixed-prefix matrices: table, claims section,
    left arm, bootstrap streams, extras."""

    table: Table
    section: str
    left: str
    stream_base: int
    cross_precision_endpoints: bool


MATCHED = MatrixDesign(MATCHED_TABLE, "matched_live_prefill", "live", 0, False)
FIXED_PREFIX = MatrixDesign(FIXED_PREFIX_TABLE, "fixed_prefix_2x2", "incremental", 100, True)
MATRIX_DESIGNS = (MATCHED, FIXED_PREFIX)


@dataclass(frozen=True)
class Difference:
    """mean(first - second) of paired 0/1 rows in points: the paper's bootstrap interval
    beside Newcombe's."""

    estimate_pp: float
    paired_bootstrap_95_ci_pp: tuple[float, float]
    newcombe_method10_95_ci_pp: tuple[float, float]


@dataclass(frozen=True)
class FirstDivergence:
    """The first differing suffix token over rows whose suffixes differ."""

    n: int
    min: int | None
    median: float | None
    max: int | None


def _omitted() -> dict[str, object]:
    """A count or median of a column a served ledger (no K/V access) does not have."""
    return key(omit=True)


@dataclass(frozen=True)
class MatrixPrecision:
    """One precision of a matrix: exactness, drift, disagreement on every endpoint, the
    first divergence and accuracy (the left arm is ``live`` or ``incremental`` where
    claims.json names it)."""

    rows: int
    left_replica_exact_rows: int = field(metadata=key("{left}_replica_exact_rows"))
    prefill_replica_exact_rows: int
    integrity_pass_rows: int
    logits_exact_rows: int
    immediate_argmax_different_rows: int
    suffix_disagreement: Rate
    trace_disagreement: Rate
    merge_disagreement: Rate
    answer_disagreement: Rate
    first_divergence: FirstDivergence
    first_token_divergence_rows: int
    left_correct: int = field(metadata=key("{left}_correct"))
    prefill_correct: int
    left_only_correct: int = field(metadata=key("{left}_only_correct"))
    prefill_only_correct: int
    accuracy_delta_prefill_minus_left_pp: float
    accuracy_paired_bootstrap_95_ci_pp: tuple[float, float]
    correctness_label_disagreement: Rate
    mcnemar_exact_two_sided_p: float
    accuracy: Difference = field(metadata=key("accuracy_delta_prefill_minus_left", extra=True))
    functional_state_equal_rows: int | None = field(default=None, metadata=_omitted())
    all_storage_disjoint_rows: int | None = field(default=None, metadata=_omitted())
    cache_exact_rows: int | None = field(default=None, metadata=_omitted())
    cache_max_abs_diff_median: float | None = field(default=None, metadata=_omitted())
    cache_mean_abs_diff_median: float | None = field(default=None, metadata=_omitted())
    logit_max_abs_diff_median: float | None = field(default=None, metadata=_omitted())
    logit_mean_abs_diff_median: float | None = field(default=None, metadata=_omitted())
    cache_relative_l2_diff_median: float | None = field(default=None, metadata=_omitted())


@dataclass(frozen=True)
class EndpointShift:
    """An endpoint's disagreement in fp32 against bf16 on the same rows."""

    bf16_count: int
    fp32_count: int
    delta_fp32_minus_bf16_pp: float
    paired_bootstrap_95_ci_pp: tuple[float, float]
    bf16_only: int
    fp32_only: int
    mcnemar_exact_two_sided_p: float
    difference: Difference = field(metadata=key(extra=True, flatten=True))


@dataclass(frozen=True)
class AccuracyEffect:
    delta_fp32_minus_bf16_pp: float
    paired_bootstrap_95_ci_pp: tuple[float, float]


@dataclass(frozen=True)
class CrossPrecision:
    """FP32-minus-BF16 effects on rows paired by order (the fixed-prefix matrix)."""

    suffix_mismatch: EndpointShift
    answer_mismatch: EndpointShift
    correctness_flip: EndpointShift
    logits_mismatch: EndpointShift
    accuracy_effect_difference: AccuracyEffect


@dataclass(frozen=True)
class MatrixPart:
    """One matrix ledger: each precision, and across bf16 and fp32 where it has both."""

    precisions: dict[str, MatrixPrecision] = field(metadata=key(flatten=True))
    cross_precision_prefix_exact_rows: int | None = field(default=None, metadata=key(omit=True))
    cross_precision: CrossPrecision | None = field(default=None, metadata=key(omit=True))


def _part(design: MatrixDesign) -> dict[str, object]:
    return key(design.section, omit=True, context={"left": design.left})


@dataclass(frozen=True)
class MatrixClaims:
    """The matched and fixed-prefix matrices, whichever the folder has."""

    matched: MatrixPart | None = field(default=None, metadata=_part(MATCHED))
    fixed_prefix: MatrixPart | None = field(default=None, metadata=_part(FIXED_PREFIX))
    note: str = field(default=NEWCOMBE_NOTE, metadata=key(extra=True))

    def parts(self) -> Iterator[tuple[MatrixDesign, MatrixPart]]:
        for design, part in ((MATCHED, self.matched), (FIXED_PREFIX, self.fixed_prefix)):
            if part is not None:
                yield design, part

    def blocks(self) -> Iterator[tuple[MatrixDesign, str, MatrixPrecision]]:
        """Every (design, precision, block) of the matrices."""
        for design, part in self.parts():
            for precision, block in part.precisions.items():
                yield design, precision, block


def _correctness_delta(rows: Ledger, left: str) -> np.ndarray:
    """d = prefill_correct - left_correct per row, in {-1, 0, 1}."""
    return rows["prefill_correct"].astype(np.int64) - rows[f"{left}_correct"].astype(np.int64)


def _endpoint_vectors(rows: Ledger, left: str) -> dict[str, np.ndarray]:
    """Per-row 0/1 mismatch vectors compared across precisions."""
    return {
        "suffix_mismatch": ~rows["suffix_equal"],
        "answer_mismatch": ~rows["answer_equal"],
        "correctness_flip": _correctness_delta(rows, left) != 0,
        "logits_mismatch": ~rows[f"{left}_prefill_logits_exact"],
    }


def _first_divergence(rows: Ledger) -> FirstDivergence:
    indices = rows["first_suffix_divergence_index"]
    indices = indices[~np.isnan(indices)]
    if not indices.size:
        return FirstDivergence(0, None, None, None)
    return FirstDivergence(
        int(indices.size), int(indices.min()), median(indices), int(indices.max())
    )


def _difference(first: np.ndarray, second: np.ndarray, stream: int) -> Difference:
    """Paper's bootstrap beside Newcombe for mean(first - second), in points."""
    difference = first.astype(np.int64) - second.astype(np.int64)
    low, high = newcombe_paired_difference_ci(first, second)
    return Difference(
        float(difference.mean() * 100),
        paired_bootstrap_ci_pp(difference, stream),
        (low * 100, high * 100),
    )


MEDIANS = (
    "cache_max_abs_diff",
    "cache_mean_abs_diff",
    "logit_max_abs_diff",
    "logit_mean_abs_diff",
    "cache_relative_l2_diff",
)
"""The columns whose median a precision's claims hold, where its ledger has them."""


def _replica_exact(rows: Ledger, arm: str) -> int:
    """Rows whose replica of ``arm`` was exact in every part its ledger records."""
    parts = [f"{replica_name(arm)}_{part}_exact" for part in ("cache", "logits", "suffix")]
    return count(np.logical_and.reduce([rows[column] for column in parts if column in rows]))


def _kv_counts(rows: Ledger, left: str) -> dict[str, int | float]:
    """What only a ledger with K/V access holds: state and storage counts, cache
    exactness and the drift medians."""
    found: dict[str, int | float] = {
        f"{column}_rows": count(rows[column])
        for column in ("functional_state_equal", "all_storage_disjoint")
        if column in rows
    }
    if f"{left}_prefill_cache_exact" in rows:
        found["cache_exact_rows"] = count(rows[f"{left}_prefill_cache_exact"])
    found |= {f"{column}_median": median(rows[column]) for column in MEDIANS if column in rows}
    return found


def _precision_block(rows: Ledger, left: str, stream: int) -> MatrixPrecision:
    """Claims for one precision of a matrix file."""
    n = len(rows)
    d = _correctness_delta(rows, left)
    left_only, prefill_only = count(d == -1), count(d == 1)
    accuracy = _difference(rows["prefill_correct"], rows[f"{left}_correct"], stream)
    disagreement = {
        f"{endpoint}_disagreement": Rate.of(count(~rows[f"{endpoint}_equal"]), n, MATRIX_WILSON_Z)
        for endpoint in ("suffix", "trace", "merge", "answer")
    }
    return MatrixPrecision(
        rows=n,
        left_replica_exact_rows=_replica_exact(rows, left),
        prefill_replica_exact_rows=_replica_exact(rows, "prefill"),
        integrity_pass_rows=count(rows["integrity_pass"]),
        logits_exact_rows=count(rows[f"{left}_prefill_logits_exact"]),
        immediate_argmax_different_rows=count(~rows["boundary_argmax_equal"]),
        **disagreement,
        first_divergence=_first_divergence(rows),
        first_token_divergence_rows=count(rows["first_suffix_divergence_index"] == 0),
        left_correct=count(rows[f"{left}_correct"]),
        prefill_correct=count(rows["prefill_correct"]),
        left_only_correct=left_only,
        prefill_only_correct=prefill_only,
        accuracy_delta_prefill_minus_left_pp=accuracy.estimate_pp,
        accuracy_paired_bootstrap_95_ci_pp=accuracy.paired_bootstrap_95_ci_pp,
        correctness_label_disagreement=Rate.of(count(d != 0), n, MATRIX_WILSON_Z),
        mcnemar_exact_two_sided_p=mcnemar_exact_p(left_only, prefill_only),
        accuracy=accuracy,
        **_kv_counts(rows, left),  # type: ignore[arg-type]
    )


def _cross_precision(bf16: Ledger, fp32: Ledger, left: str) -> CrossPrecision:
    """FP32-minus-BF16 effects on rows paired by order (fixed-prefix file only)."""
    shifts = {}
    low_endpoints, high_endpoints = _endpoint_vectors(bf16, left), _endpoint_vectors(fp32, left)
    for endpoint, stream in CROSS_PRECISION_STREAMS.items():
        low, high = low_endpoints[endpoint], high_endpoints[endpoint]
        difference = _difference(high, low, stream)
        e = high.astype(np.int64) - low.astype(np.int64)
        bf16_only, fp32_only = count(e == -1), count(e == 1)
        shifts[endpoint] = EndpointShift(
            bf16_count=count(low),
            fp32_count=count(high),
            delta_fp32_minus_bf16_pp=difference.estimate_pp,
            paired_bootstrap_95_ci_pp=difference.paired_bootstrap_95_ci_pp,
            bf16_only=bf16_only,
            fp32_only=fp32_only,
            mcnemar_exact_two_sided_p=mcnemar_exact_p(bf16_only, fp32_only),
            difference=difference,
        )
    effect = _correctness_delta(fp32, left) - _correctness_delta(bf16, left)
    accuracy = AccuracyEffect(
        float(effect.mean() * 100), paired_bootstrap_ci_pp(effect, ACCURACY_DIFFERENCE_STREAM)
    )
    return CrossPrecision(**shifts, accuracy_effect_difference=accuracy)


def precision_streams(precisions: list[str], base: int) -> dict[str, int]:
    """bf16 and fp32 use the paper's streams; any other precision follows, in sorted order."""
    others = sorted(p for p in precisions if p not in PRECISION_STREAM_OFFSET)
    offsets = {**PRECISION_STREAM_OFFSET, **{p: 2 + i for i, p in enumerate(others)}}
    return {p: base + offsets[p] for p in precisions}


def matrix_section(ledger: Ledger, design: MatrixDesign) -> MatrixPart:
    """Claims of a matched or fixed-prefix matrix, for whatever precisions it holds."""
    precisions = list(dict.fromkeys(ledger["precision"].tolist()))
    by_precision = {p: ledger.select(ledger["precision"] == p) for p in precisions}
    blocks = {
        precision: _precision_block(by_precision[precision], design.left, stream)
        for precision, stream in precision_streams(precisions, design.stream_base).items()
    }
    if "bf16" not in by_precision or "fp32" not in by_precision:
        return MatrixPart(blocks)
    bf16, fp32 = by_precision["bf16"], by_precision["fp32"]
    prefix_exact = count(
        (bf16["prefix_sha256"] == fp32["prefix_sha256"])
        & (bf16["prefix_token_count"] == fp32["prefix_token_count"])
    )
    cross = _cross_precision(bf16, fp32, design.left) if design.cross_precision_endpoints else None
    return MatrixPart(blocks, prefix_exact, cross)


def _claims(reading: Reading) -> MatrixClaims:
    parts = {
        design.section: matrix_section(ledger, design)
        for design in MATRIX_DESIGNS
        if (ledger := reading.ledgers.get(design.table.file)) is not None
    }
    return MatrixClaims(parts.get(MATCHED.section), parts.get(FIXED_PREFIX.section))


def _summary(claims: MatrixClaims) -> list[str]:
    lines = []
    for design, precision, block in claims.blocks():
        low, high = block.accuracy_paired_bootstrap_95_ci_pp
        lines.append(
            f"{design.section} {precision}: suffixes differ"
            f" {block.suffix_disagreement.text}, answers"
            f" {block.answer_disagreement.text}, correctness labels"
            f" {block.correctness_label_disagreement.text}; accuracy"
            f" {block.left_correct} vs {block.prefill_correct}"
            f" ({block.accuracy_delta_prefill_minus_left_pp:+.1f} pp,"
            f" 95% CI [{low:+.1f}, {high:+.1f}])"
        )
    return lines


Rates = Callable[[MatrixPrecision], Rate]
# The paper's published headline figures (the paper's method, last section), as reference numbers.
PAPER_BF16_RATES: tuple[tuple[str, Rates, tuple[int, int]], ...] = (
    ("suffix", lambda b: b.suffix_disagreement, (166, 200)),
    ("answer", lambda b: b.answer_disagreement, (49, 200)),
    ("correctness label", lambda b: b.correctness_label_disagreement, (20, 200)),
)
PAPER_BF16_ACCURACY = (93, 95, 200)
PAPER_BF16_DELTA_PP = (1.0, -3.5, 5.5)
PAPER_REPLICAS_EXACT = (200, 200)
PAPER_FP32_DIFFERING = (0, 200)
PAPER_FP32_WILSON_UPPER = 0.0188


def _fp32_headline(label: str, block: MatrixPrecision) -> Row:
    """FP32: every endpoint beside the paper's 0/200, with the largest Wilson upper bound."""
    differing = [rate(block) for _, rate, _ in PAPER_BF16_RATES]
    upper = max(rate.wilson_95_ci[1] for rate in differing)
    return (
        f"{label}: suffixes / answers / labels differing",
        ", ".join(rate.text for rate in differing) + f" (Wilson upper {upper:.2%})",
        f"{fraction(*PAPER_FP32_DIFFERING)} on every endpoint"
        f" (Wilson upper {PAPER_FP32_WILSON_UPPER:.2%})",
    )


def _headline_rows(label: str, left: str, block: MatrixPrecision, paper: bool) -> list[Row]:
    """Every other precision: each rate, accuracy, its change and the replicas, beside
    the paper's bf16 figures (bf16 only)."""
    rows: list[Row] = [
        (f"{label}: {name} differs", rate(block).text, fraction(*figure) if paper else "—")
        for name, rate, figure in PAPER_BF16_RATES
    ]
    low, high = block.accuracy_paired_bootstrap_95_ci_pp
    paper_delta, paper_low, paper_high = PAPER_BF16_DELTA_PP
    replicas = (block.left_replica_exact_rows, block.prefill_replica_exact_rows)
    return rows + [
        (
            f"{label}: correct, {left} vs prefill",
            f"{block.left_correct} vs {block.prefill_correct} of {block.rows}",
            "{} vs {} of {}".format(*PAPER_BF16_ACCURACY) if paper else "—",
        ),
        (
            f"{label}: accuracy change, prefill − {left} (bootstrap 95% CI)",
            f"{block.accuracy_delta_prefill_minus_left_pp:+.1f} pp {interval(low, high)}",
            f"{paper_delta:+.1f} pp {interval(paper_low, paper_high)}" if paper else "—",
        ),
        (
            f"{label}: replicas exact, {left} / prefill",
            ", ".join(fraction(exact, block.rows) for exact in replicas),
            f"{fraction(*PAPER_REPLICAS_EXACT)} on both arms" if paper else "—",
        ),
    ]


def _headline(claims: MatrixClaims) -> list[Row]:
    """Rows of the headline table: claim, this run, the paper's published figure."""
    rows: list[Row] = []
    for design, precision, block in claims.blocks():
        label = f"{design.section} {precision}"
        if precision == "fp32":
            rows.append(_fp32_headline(label, block))
        else:
            rows += _headline_rows(label, design.left, block, paper=precision == "bf16")
    return rows


ENDPOINTS: tuple[tuple[str, Rates], ...] = (
    ("suffix", lambda b: b.suffix_disagreement),
    ("trace", lambda b: b.trace_disagreement),
    ("merge", lambda b: b.merge_disagreement),
    ("answer", lambda b: b.answer_disagreement),
    ("correctness label", lambda b: b.correctness_label_disagreement),
)
"""What the disagreement table and figure both show: which rates, under which labels."""


def _accuracy_row(design: MatrixDesign, precision: str, b: MatrixPrecision) -> Row:
    return (
        design.section,
        precision,
        fraction(b.left_correct, b.rows),
        fraction(b.prefill_correct, b.rows),
        f"{b.accuracy_delta_prefill_minus_left_pp:+.1f}",
        interval(*b.accuracy_paired_bootstrap_95_ci_pp),
        interval(*b.accuracy.newcombe_method10_95_ci_pp),
        f"{b.mcnemar_exact_two_sided_p:.3g}",
    )


ACCURACY_COLUMNS = (
    "section",
    "precision",
    "left correct",
    "prefill correct",
    "change (pp)",
    "bootstrap 95% CI",
    "Newcombe 95% CI",
    "McNemar p",
)


def _report(page: Page[MatrixClaims]) -> list[Block]:
    matrix = list(page.claims.blocks())
    if not matrix:
        return []
    blocks: list[Block] = [
        Heading("Disagreement rates (Wilson 95% intervals)"),
        Grid(
            ("section", "precision", "endpoint", "count/n", "rate [95% CI, %]"),
            [
                (d.section, p, label, rate(b).text, rate(b).percent)
                for d, p, b in matrix
                for label, rate in ENDPOINTS
            ],
        ),
    ]
    if figure := _figure_disagreement(page):
        blocks.append(Image(figure, "Rows where prefill and the left arm disagree, by endpoint."))
    blocks += [
        Heading("Accuracy per arm"),
        Grid(ACCURACY_COLUMNS, [_accuracy_row(d, p, b) for d, p, b in matrix]),
    ]
    if figure := _figure_accuracy(page):
        caption = "Accuracy of each arm; prefill minus left with its paired bootstrap interval."
        blocks.append(Image(figure, caption))
    blocks.append(Heading("Where suffixes first diverge"))
    if figure := _figure_first_divergence(page):
        caption = "First differing suffix token, over rows whose suffixes differ."
        blocks.append(Image(figure, caption))
    else:
        blocks.append(Paragraph("No suffix diverged, so there is no histogram."))
    blocks.append(Heading("Cache drift by layer"))
    figure, note = _figure_layer_drift(page)
    blocks.append(Image(figure, note) if figure else Paragraph(note))
    return blocks


def _figure_disagreement(page: Page[MatrixClaims]) -> Path | None:
    """One panel per matrix section: each endpoint's disagreement rate, per precision."""
    parts = list(page.claims.parts())
    if not parts:
        return None
    figure, axes = page.figures.panels(len(parts))
    for ax, (design, part) in zip(axes, parts, strict=True):
        series = {
            precision: [rate(block) for _, rate in ENDPOINTS]
            for precision, block in part.precisions.items()
        }
        labels = [label for label, _ in ENDPOINTS]
        page.figures.rate_bars(ax, labels, series, "rows disagreeing (%)")
        ax.set_title(f"{design.section}: prefill vs {design.left}", fontsize=10)
    return page.figures.save(figure, "disagreement_rates.png")


def _figure_accuracy(page: Page[MatrixClaims]) -> Path | None:
    """Accuracy of each arm beside prefill minus left with its paired bootstrap interval."""
    blocks = list(page.claims.blocks())
    if not blocks:
        return None
    figure, (arms, deltas) = page.figures.panels(2, height=4.0)
    names = [f"{d.section.split('_')[0]}\n{p}" for d, p, _ in blocks]
    positions = np.arange(len(blocks))
    for offset, arm, colour in ((-0.2, "left", "#7f8c8d"), (0.2, "prefill", "#16a085")):
        rates = [
            100 * (b.left_correct if arm == "left" else b.prefill_correct) / b.rows
            for _, _, b in blocks
        ]
        arms.bar(positions + offset, rates, 0.4, label=f"{arm} arm", color=colour)
    arms.set_xticks(positions, names, fontsize=8)
    arms.set_ylabel("accuracy (%)")
    arms.set_ylim(0, 100)
    arms.legend(fontsize=8)
    arms.set_title("accuracy per arm", fontsize=10)
    estimates = np.array([b.accuracy_delta_prefill_minus_left_pp for _, _, b in blocks])
    bounds = np.array([b.accuracy_paired_bootstrap_95_ci_pp for _, _, b in blocks])
    error = np.clip(np.vstack([estimates - bounds[:, 0], bounds[:, 1] - estimates]), 0, None)
    deltas.errorbar(positions, estimates, yerr=error, fmt="o", capsize=4, color="#34495e")
    deltas.axhline(0, color="#999999", linewidth=0.8)
    deltas.set_xticks(positions, names, fontsize=8)
    deltas.set_ylabel("prefill − left (pp)")
    deltas.set_title("accuracy change, paired bootstrap 95% CI", fontsize=10)
    return page.figures.save(figure, "accuracy.png")


def _figure_first_divergence(page: Page[MatrixClaims]) -> Path | None:
    """Histogram of the first differing suffix token, over rows whose suffixes differ."""
    data: dict[str, dict[str, np.ndarray]] = {}
    for design in MATRIX_DESIGNS:
        if (ledger := page.ledgers.get(design.table.file)) is None:
            continue
        for precision in dict.fromkeys(ledger["precision"].tolist()):
            indices = ledger["first_suffix_divergence_index"][ledger["precision"] == precision]
            if (indices := indices[~np.isnan(indices)]).size:
                data.setdefault(design.section, {})[precision] = indices
    if not data:
        return None
    figure, axes = page.figures.panels(len(data))
    for ax, (section, per_precision) in zip(axes, data.items(), strict=True):
        for precision, indices in per_precision.items():
            ax.hist(
                indices,
                bins=30,
                histtype="step",
                linewidth=1.5,
                color=page.figures.colour(precision),
                label=f"{precision} (n={indices.size})",
            )
        ax.set_xlabel("first differing suffix token index")
        ax.set_ylabel("rows")
        page.figures.integer_ticks(ax.yaxis)
        ax.set_title(section, fontsize=10)
        ax.legend(fontsize=8)
    return page.figures.save(figure, "first_divergence.png")


def _layer_drift(ledger: Ledger) -> dict[str, np.ndarray]:
    """Each precision's relative L2 by layer (a row per row), read again from the
    ledger's lines: analysis holds no column of it; none where its CSV has no such
    column (the paper's CSVs, a served run's)."""
    drift: dict[str, list[list[float]]] = {}
    for line in ledger.lines():
        if line.get(LAYER_DRIFT) is None:
            return {}
        drift.setdefault(line["precision"], []).append(line[LAYER_DRIFT])
    return {precision: np.array(rows) for precision, rows in drift.items()}


def _figure_layer_drift(page: Page[MatrixClaims]) -> tuple[Path | None, str]:
    """Median relative L2 by layer, per precision, on a log axis; a note on what was left out."""
    with_layers = [
        (design, drift)
        for design in MATRIX_DESIGNS
        if (ledger := page.ledgers.get(design.table.file)) is not None
        and (drift := _layer_drift(ledger))
    ]
    if not with_layers:
        return None, (
            f"No ledger carries a `{LAYER_DRIFT}` column (the paper's CSVs do not),"
            " so the per-layer cache drift figure is skipped."
        )
    figure, axes = page.figures.panels(len(with_layers))
    exact_layers = 0
    for ax, (design, by_precision) in zip(axes, with_layers, strict=True):
        for precision, drift in by_precision.items():
            layer_median = np.median(drift, axis=0)
            exact_layers += int(np.count_nonzero(layer_median <= 0))
            layers = np.arange(layer_median.size)
            positive = layer_median > 0
            ax.plot(
                layers[positive],
                layer_median[positive],
                marker="o",
                markersize=3,
                color=page.figures.colour(precision),
                label=precision,
            )
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("median relative L2 (prefill vs left)")
        ax.set_title(f"{design.section}: cache drift by layer", fontsize=10)
        ax.legend(fontsize=8)
    note = (
        f" {exact_layers} layer medians are exactly zero and are not drawn on the log axis."
        if exact_layers
        else ""
    )
    path = page.figures.save(figure, "cache_drift_by_layer.png")
    return path, "Median over rows of each layer's relative L2 cache difference." + note


MATRIX = Section(
    "matrix",
    (MATCHED_TABLE, SERVED_MATCHED_TABLE, FIXED_PREFIX_TABLE),
    MatrixClaims,
    _claims,
    _summary,
    _headline,
    _report,
    paper_order=1,
)
