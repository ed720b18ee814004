"""The matrix section: ``matched`` and ``fixed-prefix`` ledgers (a served ``matched`` one
too) as the paper's claims, per precision and across precisions, computed as the paper's
published method specifies; their summary lines, headline rows beside the paper's
published figures, and report blocks (disagreement, accuracy, first divergence, drift by
layer)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvreplay.experiments.matrix.table import (
    FIXED_PREFIX_TABLE,
    LAYER_DRIFT,
    MATCHED_TABLE,
    SERVED_MATCHED_TABLE,
)
from kvreplay.harness.rows import replica_name
from kvreplay.harness.section import Page, Reading, Row, Section
from kvreplay.harness.table import Ledger, Table
from kvreplay.measure.rates import (
    Json,
    count,
    fraction,
    interval,
    median,
    percent_interval,
    rate_payload,
    rate_text,
)
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


MATRIX_DESIGNS = (
    MatrixDesign(MATCHED_TABLE, "matched_live_prefill", "live", 0, False),
    MatrixDesign(FIXED_PREFIX_TABLE, "fixed_prefix_2x2", "incremental", 100, True),
)


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


def _first_divergence(rows: Ledger) -> Json:
    indices = rows["first_suffix_divergence_index"]
    indices = indices[~np.isnan(indices)]
    if not indices.size:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {
        "n": int(indices.size),
        "min": int(indices.min()),
        "median": median(indices),
        "max": int(indices.max()),
    }


def _difference_payload(first: np.ndarray, second: np.ndarray, stream: int) -> Json:
    """Paper's bootstrap beside Newcombe for mean(first - second), in points."""
    difference = first.astype(np.int64) - second.astype(np.int64)
    low, high = newcombe_paired_difference_ci(first, second)
    return {
        "estimate_pp": float(difference.mean() * 100),
        "paired_bootstrap_95_ci_pp": list(paired_bootstrap_ci_pp(difference, stream)),
        "newcombe_method10_95_ci_pp": [low * 100, high * 100],
    }


def _precision_block(rows: Ledger, left: str, stream: int) -> tuple[Json, Json]:
    """Claims for one precision of a matrix file, plus its Newcombe extra."""
    n = len(rows)
    d = _correctness_delta(rows, left)
    left_only, prefill_only = count(d == -1), count(d == 1)
    accuracy = _difference_payload(rows["prefill_correct"], rows[f"{left}_correct"], stream)
    block: Json = {
        "rows": n,
        **{
            f"{replica_name(arm)}_exact_rows": count(
                np.logical_and.reduce(
                    [
                        rows[f"{replica_name(arm)}_{part}_exact"]
                        for part in ("cache", "logits", "suffix")
                        if f"{replica_name(arm)}_{part}_exact" in rows
                    ]  # fmt: skip
                )
            )
            for arm in (left, "prefill")
        },
        # a served ledger (no K/V access) has no cache, state or storage columns
        **{
            f"{column}_rows": count(rows[column])
            for column in ("functional_state_equal", "all_storage_disjoint")
            if column in rows
        },
        "integrity_pass_rows": count(rows["integrity_pass"]),
        **(
            {"cache_exact_rows": count(rows[f"{left}_prefill_cache_exact"])}
            if f"{left}_prefill_cache_exact" in rows
            else {}
        ),
        "logits_exact_rows": count(rows[f"{left}_prefill_logits_exact"]),
        **{
            f"{column}_median": median(rows[column])
            for column in (
                "cache_max_abs_diff",
                "cache_mean_abs_diff",
                "logit_max_abs_diff",
                "logit_mean_abs_diff",
                "cache_relative_l2_diff",
            )
            if column in rows
        },
        "immediate_argmax_different_rows": count(~rows["boundary_argmax_equal"]),
        **{
            f"{endpoint}_disagreement": rate_payload(
                count(~rows[f"{endpoint}_equal"]), n, MATRIX_WILSON_Z
            )
            for endpoint in ("suffix", "trace", "merge", "answer")
        },
        "first_divergence": _first_divergence(rows),
        "first_token_divergence_rows": count(rows["first_suffix_divergence_index"] == 0),
        f"{left}_correct": count(rows[f"{left}_correct"]),
        "prefill_correct": count(rows["prefill_correct"]),
        f"{left}_only_correct": left_only,
        "prefill_only_correct": prefill_only,
        "accuracy_delta_prefill_minus_left_pp": accuracy["estimate_pp"],
        "accuracy_paired_bootstrap_95_ci_pp": accuracy["paired_bootstrap_95_ci_pp"],
        "correctness_label_disagreement": rate_payload(count(d != 0), n, MATRIX_WILSON_Z),
        "mcnemar_exact_two_sided_p": mcnemar_exact_p(left_only, prefill_only),
    }
    extra = {"accuracy_delta_prefill_minus_left": accuracy}
    return block, extra


def _cross_precision(bf16: Ledger, fp32: Ledger, left: str) -> tuple[Json, Json]:
    """FP32-minus-BF16 effects on rows paired by order (fixed-prefix file only)."""
    section: Json = {}
    extra: Json = {}
    low_endpoints, high_endpoints = _endpoint_vectors(bf16, left), _endpoint_vectors(fp32, left)
    for endpoint, stream in CROSS_PRECISION_STREAMS.items():
        low, high = low_endpoints[endpoint], high_endpoints[endpoint]
        payload = _difference_payload(high, low, stream)
        e = high.astype(np.int64) - low.astype(np.int64)
        bf16_only, fp32_only = count(e == -1), count(e == 1)
        section[endpoint] = {
            "bf16_count": count(low),
            "fp32_count": count(high),
            "delta_fp32_minus_bf16_pp": payload["estimate_pp"],
            "paired_bootstrap_95_ci_pp": payload["paired_bootstrap_95_ci_pp"],
            "bf16_only": bf16_only,
            "fp32_only": fp32_only,
            "mcnemar_exact_two_sided_p": mcnemar_exact_p(bf16_only, fp32_only),
        }
        extra[endpoint] = payload
    effect = _correctness_delta(fp32, left) - _correctness_delta(bf16, left)
    section["accuracy_effect_difference"] = {
        "delta_fp32_minus_bf16_pp": float(effect.mean() * 100),
        "paired_bootstrap_95_ci_pp": list(
            paired_bootstrap_ci_pp(effect, ACCURACY_DIFFERENCE_STREAM)
        ),
    }
    return section, extra


def precision_streams(precisions: list[str], base: int) -> dict[str, int]:
    """bf16 and fp32 use the paper's streams; any other precision follows, in sorted order."""
    others = sorted(p for p in precisions if p not in PRECISION_STREAM_OFFSET)
    offsets = {**PRECISION_STREAM_OFFSET, **{p: 2 + i for i, p in enumerate(others)}}
    return {p: base + offsets[p] for p in precisions}


def matrix_section(ledger: Ledger, design: MatrixDesign) -> tuple[Json, Json]:
    """Claims and extras of a matched or fixed-prefix matrix, for whatever precisions it holds."""
    precisions = list(dict.fromkeys(ledger["precision"].tolist()))
    by_precision = {p: ledger.select(ledger["precision"] == p) for p in precisions}
    section: Json = {}
    extra: Json = {}
    for precision, stream in precision_streams(precisions, design.stream_base).items():
        section[precision], extra[precision] = _precision_block(
            by_precision[precision], design.left, stream
        )
    if "bf16" in by_precision and "fp32" in by_precision:
        bf16, fp32 = by_precision["bf16"], by_precision["fp32"]
        section["cross_precision_prefix_exact_rows"] = count(
            (bf16["prefix_sha256"] == fp32["prefix_sha256"])
            & (bf16["prefix_token_count"] == fp32["prefix_token_count"])
        )
        if design.cross_precision_endpoints:
            section["cross_precision"], extra["cross_precision"] = _cross_precision(
                bf16, fp32, design.left
            )
    return section, extra


def _claims(reading: Reading) -> Json:
    claims: Json = {}
    extra: Json = {"note": NEWCOMBE_NOTE}
    for design in MATRIX_DESIGNS:
        if (ledger := reading.ledgers.get(design.table.file)) is not None:
            claims[design.section], extra[design.section] = matrix_section(ledger, design)
    return {**claims, "extra": extra}


def matrix_blocks(claims: Json) -> Iterator[tuple[MatrixDesign, str, Json]]:
    """Every (design, precision, per-precision block) of the matrix sections in claims."""
    for design in MATRIX_DESIGNS:
        for precision, block in claims.get(design.section, {}).items():
            if isinstance(block, dict) and "rows" in block:
                yield design, precision, block


def _summary(claims: Json) -> list[str]:
    lines = []
    for design, precision, block in matrix_blocks(claims):
        low, high = block["accuracy_paired_bootstrap_95_ci_pp"]
        lines.append(
            f"{design.section} {precision}: suffixes differ"
            f" {rate_text(block['suffix_disagreement'])}, answers"
            f" {rate_text(block['answer_disagreement'])}, correctness labels"
            f" {rate_text(block['correctness_label_disagreement'])}; accuracy"
            f" {block[design.left + '_correct']} vs {block['prefill_correct']}"
            f" ({block['accuracy_delta_prefill_minus_left_pp']:+.1f} pp,"
            f" 95% CI [{low:+.1f}, {high:+.1f}])"
        )
    return lines


# The paper's published headline figures (the paper's method, last section), as reference numbers.
PAPER_BF16_RATES = {
    "suffix_disagreement": (166, 200),
    "answer_disagreement": (49, 200),
    "correctness_label_disagreement": (20, 200),
}
PAPER_BF16_ACCURACY = (93, 95, 200)
PAPER_BF16_DELTA_PP = (1.0, -3.5, 5.5)
PAPER_REPLICAS_EXACT = (200, 200)
PAPER_FP32_DIFFERING = (0, 200)
PAPER_FP32_WILSON_UPPER = 0.0188


def _headline(claims: Json) -> list[Row]:
    """Rows of the headline table: claim, this run, the paper's published figure."""
    rows: list[Row] = []
    for design, precision, block in matrix_blocks(claims):
        label = f"{design.section} {precision}"
        if precision == "fp32":
            differing = [block[key] for key in PAPER_BF16_RATES]
            upper = max(payload["wilson_95_ci"][1] for payload in differing)
            rows.append(
                (
                    f"{label}: suffixes / answers / labels differing",
                    ", ".join(rate_text(p) for p in differing) + f" (Wilson upper {upper:.2%})",
                    f"{fraction(*PAPER_FP32_DIFFERING)} on every endpoint"
                    f" (Wilson upper {PAPER_FP32_WILSON_UPPER:.2%})",
                )
            )
            continue
        paper = precision == "bf16"
        for key, (hits, n) in PAPER_BF16_RATES.items():
            name = key.removesuffix("_disagreement").replace("_", " ")
            rows.append(
                (
                    f"{label}: {name} differs",
                    rate_text(block[key]),
                    fraction(hits, n) if paper else "—",
                )
            )
        left_correct, prefill_correct = block[f"{design.left}_correct"], block["prefill_correct"]
        rows.append(
            (
                f"{label}: correct, {design.left} vs prefill",
                f"{left_correct} vs {prefill_correct} of {block['rows']}",
                "{} vs {} of {}".format(*PAPER_BF16_ACCURACY) if paper else "—",
            )
        )
        delta, (low, high) = (
            block["accuracy_delta_prefill_minus_left_pp"],
            block["accuracy_paired_bootstrap_95_ci_pp"],
        )
        paper_delta, paper_low, paper_high = PAPER_BF16_DELTA_PP
        rows.append(
            (
                f"{label}: accuracy change, prefill − {design.left} (bootstrap 95% CI)",
                f"{delta:+.1f} pp {interval(low, high)}",
                f"{paper_delta:+.1f} pp {interval(paper_low, paper_high)}" if paper else "—",
            )
        )
        rows.append(
            (
                f"{label}: replicas exact, {design.left} / prefill",
                ", ".join(
                    fraction(block[f"{replica_name(arm)}_exact_rows"], block["rows"])
                    for arm in (design.left, "prefill")
                ),
                f"{fraction(*PAPER_REPLICAS_EXACT)} on both arms" if paper else "—",
            )
        )
    return rows


ENDPOINTS = (
    ("suffix_disagreement", "suffix"),
    ("trace_disagreement", "trace"),
    ("merge_disagreement", "merge"),
    ("answer_disagreement", "answer"),
    ("correctness_label_disagreement", "correctness label"),
)
"""What the disagreement table and figure both show: which rates, under which labels."""


def _report(page: Page) -> list[Block]:
    claims = page.claims
    matrix = list(matrix_blocks(claims))
    if not matrix:
        return []
    blocks: list[Block] = [
        Heading("Disagreement rates (Wilson 95% intervals)"),
        Grid(
            ("section", "precision", "endpoint", "count/n", "rate [95% CI, %]"),
            [
                (d.section, p, label, rate_text(b[key]), percent_interval(b[key]))
                for d, p, b in matrix
                for key, label in ENDPOINTS
            ],
        ),
    ]
    if figure := _figure_disagreement(page):
        blocks.append(Image(figure, "Rows where prefill and the left arm disagree, by endpoint."))
    extra = claims.get("extra", {})
    blocks += [
        Heading("Accuracy per arm"),
        Grid(
            (
                "section",
                "precision",
                "left correct",
                "prefill correct",
                "change (pp)",
                "bootstrap 95% CI",
                "Newcombe 95% CI",
                "McNemar p",
            ),
            [
                (
                    d.section,
                    p,
                    fraction(b[f"{d.left}_correct"], b["rows"]),
                    fraction(b["prefill_correct"], b["rows"]),
                    f"{b['accuracy_delta_prefill_minus_left_pp']:+.1f}",
                    interval(*b["accuracy_paired_bootstrap_95_ci_pp"]),
                    interval(*newcombe)
                    if (
                        newcombe := extra.get(d.section, {})
                        .get(p, {})
                        .get("accuracy_delta_prefill_minus_left", {})
                        .get("newcombe_method10_95_ci_pp")
                    )
                    else "—",
                    f"{b['mcnemar_exact_two_sided_p']:.3g}",
                )
                for d, p, b in matrix
            ],
        ),
    ]
    if figure := _figure_accuracy(page):
        blocks.append(
            Image(
                figure,
                "Accuracy of each arm; prefill minus left with its paired bootstrap interval.",
            )
        )
    blocks.append(Heading("Where suffixes first diverge"))
    if figure := _figure_first_divergence(page):
        blocks.append(
            Image(figure, "First differing suffix token, over rows whose suffixes differ.")
        )
    else:
        blocks.append(Paragraph("No suffix diverged, so there is no histogram."))
    blocks.append(Heading("Cache drift by layer"))
    figure, note = _figure_layer_drift(page)
    blocks.append(Image(figure, note) if figure else Paragraph(note))
    return blocks


def _figure_disagreement(page: Page) -> Path | None:
    """One panel per matrix section: each endpoint's disagreement rate, per precision."""
    sections = [d for d in MATRIX_DESIGNS if d.section in page.claims]
    if not sections:
        return None
    figure, axes = page.figures.panels(len(sections))
    for ax, design in zip(axes, sections, strict=True):
        series = {
            precision: [block[key] for key, _ in ENDPOINTS]
            for d, precision, block in matrix_blocks(page.claims)
            if d == design
        }
        labels = [label for _, label in ENDPOINTS]
        page.figures.rate_bars(ax, labels, series, "rows disagreeing (%)")
        ax.set_title(f"{design.section}: prefill vs {design.left}", fontsize=10)
    return page.figures.save(figure, "disagreement_rates.png")


def _figure_accuracy(page: Page) -> Path | None:
    """Accuracy of each arm beside prefill minus left with its paired bootstrap interval."""
    blocks = list(matrix_blocks(page.claims))
    if not blocks:
        return None
    figure, (arms, deltas) = page.figures.panels(2, height=4.0)
    names = [f"{d.section.split('_')[0]}\n{p}" for d, p, _ in blocks]
    positions = np.arange(len(blocks))
    for offset, arm, colour in ((-0.2, "left", "#7f8c8d"), (0.2, "prefill", "#16a085")):
        rates = [
            100 * b[f"{d.left}_correct" if arm == "left" else "prefill_correct"] / b["rows"]
            for d, _, b in blocks
        ]
        arms.bar(positions + offset, rates, 0.4, label=f"{arm} arm", color=colour)
    arms.set_xticks(positions, names, fontsize=8)
    arms.set_ylabel("accuracy (%)")
    arms.set_ylim(0, 100)
    arms.legend(fontsize=8)
    arms.set_title("accuracy per arm", fontsize=10)
    estimates = np.array([b["accuracy_delta_prefill_minus_left_pp"] for _, _, b in blocks])
    bounds = np.array([b["accuracy_paired_bootstrap_95_ci_pp"] for _, _, b in blocks])
    error = np.clip(np.vstack([estimates - bounds[:, 0], bounds[:, 1] - estimates]), 0, None)
    deltas.errorbar(positions, estimates, yerr=error, fmt="o", capsize=4, color="#34495e")
    deltas.axhline(0, color="#999999", linewidth=0.8)
    deltas.set_xticks(positions, names, fontsize=8)
    deltas.set_ylabel("prefill − left (pp)")
    deltas.set_title("accuracy change, paired bootstrap 95% CI", fontsize=10)
    return page.figures.save(figure, "accuracy.png")


def _figure_first_divergence(page: Page) -> Path | None:
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


def _figure_layer_drift(page: Page) -> tuple[Path | None, str]:
    """Median relative L2 by layer, per precision, on a log axis; a note on what was left out."""
    with_layers = [
        (design, ledger)
        for design in MATRIX_DESIGNS
        if (ledger := page.ledgers.get(design.table.file)) is not None and LAYER_DRIFT in ledger
    ]
    if not with_layers:
        return None, (
            f"No ledger carries a `{LAYER_DRIFT}` column (the paper's CSVs do not),"
            " so the per-layer cache drift figure is skipped."
        )
    figure, axes = page.figures.panels(len(with_layers))
    exact_layers = 0
    for ax, (design, ledger) in zip(axes, with_layers, strict=True):
        for precision in dict.fromkeys(ledger["precision"].tolist()):
            drift = np.stack(ledger[LAYER_DRIFT][ledger["precision"] == precision])
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
    _claims,
    _summary,
    _headline,
    _report,
    paper_order=1,
)
