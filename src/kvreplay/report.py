"""Markdown and self-contained HTML report of a run, set beside the paper's figures.

The report is built from the run's ledgers and claims alone, so it works on a
kvreplay run directory and on a bare folder of CSVs (such as the paper's
release) alike. Figures are drawn with matplotlib's Agg renderer and embedded
in the HTML as base64 PNG, so the page needs no network and no scripts.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvreplay.analysis.claims import (
    MATRIX_DESIGNS,
    SCHEMA,
    build_claims,
    matrix_blocks,
    write_claims,
)
from kvreplay.analysis.flip import (
    AUDIT_SHARE,
    PRIMARY_SCORE,
    SCORES,
    FlipAnalysis,
    analyze_flip,
    roc_points,
)
from kvreplay.analysis.ledgers import (
    LAYER_DRIFT_COLUMN,
    RESAMPLE_FILE,
    SERVED_CONTROLS,
    Ledger,
    LedgerError,
    load_ledger_dir,
)

Json = dict[str, Any]

# The paper's published headline figures (METHOD.md, last section), as reference numbers.
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
PAPER_BRIDGE_EXACT = (12, 12)
PAPER_TRANSPLANT = {"primary": ((24, 24), (0, 8)), "later": ((43, 43), (0, 5))}

ENDPOINTS = (
    ("suffix_disagreement", "suffix"),
    ("trace_disagreement", "trace"),
    ("merge_disagreement", "merge"),
    ("answer_disagreement", "answer"),
    ("correctness_label_disagreement", "correctness label"),
)
TRANSPLANT_RATES = (
    ("baseline_divergence", "baseline divergent"),
    ("incremental_cache_into_prefill_donor_recovery", "replay cache → prefill"),
    ("prefill_cache_into_incremental_donor_recovery", "prefill cache → replay"),
    ("bidirectional_donor_recovery", "both ways"),
    ("exact_control_novel_trajectory", "exact control changed"),
)
PRECISION_COLOURS = {"bf16": "#c0392b", "fp32": "#2471a3"}


@dataclass(frozen=True)
class Heading:
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]


@dataclass(frozen=True)
class Image:
    path: Path
    caption: str


Block = Heading | Paragraph | Table | Image


@dataclass(frozen=True)
class ReportPaths:
    """Where build_report wrote its outputs."""

    markdown: Path
    html: Path
    figures: tuple[Path, ...]


def _fraction(count: int, n: int) -> str:
    return f"{count}/{n}"


def _rate_text(payload: Json) -> str:
    return _fraction(payload["count"], payload["n"])


def _interval(low: float, high: float) -> str:
    return f"[{low:+.1f}, {high:+.1f}]"


def _percent_interval(payload: Json) -> str:
    low, high = payload["wilson_95_ci"]
    return f"{100 * payload['rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def _transplants(claims: Json) -> Iterator[tuple[str, Json]]:
    for section, block in claims.items():
        if section.startswith("transplant_"):
            yield section.removeprefix("transplant_"), block


def _headline_rows(claims: Json) -> list[tuple[str, ...]]:
    """Rows of the headline table: claim, this run, the paper's published figure."""
    rows: list[tuple[str, ...]] = []
    for design, precision, block in matrix_blocks(claims):
        label = f"{design.section} {precision}"
        if precision == "fp32":
            differing = [block[key] for key in PAPER_BF16_RATES]
            upper = max(payload["wilson_95_ci"][1] for payload in differing)
            rows.append(
                (
                    f"{label}: suffixes / answers / labels differing",
                    ", ".join(_rate_text(p) for p in differing) + f" (Wilson upper {upper:.2%})",
                    f"{_fraction(*PAPER_FP32_DIFFERING)} on every endpoint"
                    f" (Wilson upper {PAPER_FP32_WILSON_UPPER:.2%})",
                )
            )
            continue
        paper = precision == "bf16"
        for key, (count, n) in PAPER_BF16_RATES.items():
            name = key.removesuffix("_disagreement").replace("_", " ")
            rows.append(
                (
                    f"{label}: {name} differs",
                    _rate_text(block[key]),
                    _fraction(count, n) if paper else "—",
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
                f"{delta:+.1f} pp {_interval(low, high)}",
                f"{paper_delta:+.1f} pp {_interval(paper_low, paper_high)}" if paper else "—",
            )
        )
        rows.append(
            (
                f"{label}: replicas exact, {design.left} / prefill",
                f"{_fraction(block[f'{design.left}_replica_exact_rows'], block['rows'])}, "
                f"{_fraction(block['prefill_replica_exact_rows'], block['rows'])}",
                f"{_fraction(*PAPER_REPLICAS_EXACT)} on both arms" if paper else "—",
            )
        )
    if bridge := claims.get("prospective_bridge"):
        rows.append(
            (
                "prospective bridge: live vs teacher-forced, suffix exact",
                _fraction(bridge["live_teacher_suffix_exact_rows"], bridge["rows"]),
                _fraction(*PAPER_BRIDGE_EXACT),
            )
        )
    for name, block in _transplants(claims):
        recovery, controls = PAPER_TRANSPLANT.get(name, (None, None))
        rows.append(
            (
                f"transplant {name}: donor recovered both ways",
                _rate_text(block["bidirectional_donor_recovery"]),
                _fraction(*recovery) if recovery else "—",
            )
        )
        rows.append(
            (
                f"transplant {name}: exact controls changed",
                _rate_text(block["exact_control_novel_trajectory"]),
                _fraction(*controls) if controls else "—",
            )
        )
    return rows


def _new_figure(panels: int, height: float = 3.6) -> tuple[Figure, list[Any]]:
    figure = Figure(figsize=(max(5.0, 4.6 * panels), height), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def _save(figure: Figure, path: Path) -> Path:
    """PNG without a Software stamp, so reruns produce identical bytes."""
    figure.savefig(path, format="png", dpi=110, metadata={"Software": None})
    return path


def _colour(precision: str) -> str | None:
    return PRECISION_COLOURS.get(precision)


def _rate_bars(ax: Any, labels: list[str], series: dict[str, list[Json]], ylabel: str) -> None:
    """Grouped bars of rate payloads with Wilson error bars and count/n labels."""
    width = 0.8 / max(1, len(series))
    positions = np.arange(len(labels))
    for i, (name, payloads) in enumerate(series.items()):
        rates = np.array([100 * p["rate"] for p in payloads])
        bounds = np.array([[100 * b for b in p["wilson_95_ci"]] for p in payloads])
        error = np.clip(np.vstack([rates - bounds[:, 0], bounds[:, 1] - rates]), 0, None)
        x = positions + (i - (len(series) - 1) / 2) * width
        ax.bar(x, rates, width, yerr=error, capsize=3, label=name, color=_colour(name))
        for xi, payload, top in zip(x, payloads, bounds[:, 1], strict=True):
            ax.annotate(
                _rate_text(payload),
                (xi, top),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(positions, labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8)


def _figure_disagreement(claims: Json, path: Path) -> Path | None:
    sections = [d for d in MATRIX_DESIGNS if d.section in claims]
    if not sections:
        return None
    figure, axes = _new_figure(len(sections))
    for ax, design in zip(axes, sections, strict=True):
        series = {
            precision: [block[key] for key, _ in ENDPOINTS]
            for d, precision, block in matrix_blocks(claims)
            if d == design
        }
        _rate_bars(ax, [label for _, label in ENDPOINTS], series, "rows disagreeing (%)")
        ax.set_title(f"{design.section}: prefill vs {design.left}", fontsize=10)
    return _save(figure, path)


def _figure_accuracy(claims: Json, path: Path) -> Path | None:
    blocks = list(matrix_blocks(claims))
    if not blocks:
        return None
    figure, (arms, deltas) = _new_figure(2, height=4.0)
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
    return _save(figure, path)


def _figure_first_divergence(ledgers: dict[str, Ledger], path: Path) -> Path | None:
    data: dict[str, dict[str, np.ndarray]] = {}
    for design in MATRIX_DESIGNS:
        if (ledger := ledgers.get(design.file)) is None:
            continue
        for precision in dict.fromkeys(ledger["precision"].tolist()):
            indices = ledger["first_suffix_divergence_index"][ledger["precision"] == precision]
            if (indices := indices[~np.isnan(indices)]).size:
                data.setdefault(design.section, {})[precision] = indices
    if not data:
        return None
    figure, axes = _new_figure(len(data))
    for ax, (section, per_precision) in zip(axes, data.items(), strict=True):
        for precision, indices in per_precision.items():
            ax.hist(
                indices,
                bins=30,
                histtype="step",
                linewidth=1.5,
                color=_colour(precision),
                label=f"{precision} (n={indices.size})",
            )
        ax.set_xlabel("first differing suffix token index")
        ax.set_ylabel("rows")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(section, fontsize=10)
        ax.legend(fontsize=8)
    return _save(figure, path)


def _figure_layer_drift(ledgers: dict[str, Ledger], path: Path) -> tuple[Path | None, str]:
    """Median relative L2 by layer, per precision, on a log axis; a note on what was left out."""
    with_layers = [
        (design, ledger)
        for design in MATRIX_DESIGNS
        if (ledger := ledgers.get(design.file)) is not None and LAYER_DRIFT_COLUMN in ledger
    ]
    if not with_layers:
        return None, (
            f"No ledger carries a `{LAYER_DRIFT_COLUMN}` column (the paper's CSVs do not),"
            " so the per-layer cache drift figure is skipped."
        )
    figure, axes = _new_figure(len(with_layers))
    exact_layers = 0
    for ax, (design, ledger) in zip(axes, with_layers, strict=True):
        for precision in dict.fromkeys(ledger["precision"].tolist()):
            drift = np.stack(ledger[LAYER_DRIFT_COLUMN][ledger["precision"] == precision])
            median = np.median(drift, axis=0)
            exact_layers += int(np.count_nonzero(median <= 0))
            layers = np.arange(median.size)
            positive = median > 0
            ax.plot(
                layers[positive],
                median[positive],
                marker="o",
                markersize=3,
                color=_colour(precision),
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
    return _save(
        figure, path
    ), "Median over rows of each layer's relative L2 cache difference." + note


def _figure_transplant(claims: Json, path: Path) -> Path | None:
    transplants = list(_transplants(claims))
    if not transplants:
        return None
    figure, (ax,) = _new_figure(1, height=4.0)
    figure.set_figwidth(max(6.0, 2.2 * len(TRANSPLANT_RATES)))
    series = {name: [block[key] for key, _ in TRANSPLANT_RATES] for name, block in transplants}
    _rate_bars(ax, [label for _, label in TRANSPLANT_RATES], series, "rows (%)")
    ax.set_title("whole-cache transplant: recipient follows the cache donor", fontsize=10)
    return _save(figure, path)


SCORE_COLOURS = ("#8e44ad", "#d35400", "#27ae60")
FLIP_METHOD_NOTE = (
    "Flip predictor (beyond the paper). Each row gets a risk score from the left arm's"
    " trajectory alone, known before any prefill is built: the top-1 minus top-2 logit"
    " margin of every decoded suffix step (the live arm of `matched`; the replay arm of"
    " `fixed-prefix`, bit-exact with live). A greedy suffix can only change where a"
    " rebuilt state moves the logits past such a margin. Scores, fixed in advance and all"
    " reported: {scores}; `{primary}` was named primary before any run was scored. The"
    " label is suffix divergence (`suffix_equal` false). AUC is the Mann-Whitney"
    " probability that a divergent row outranks an exact one, ties counted half; it is"
    " undefined when a precision has no divergent or no exact row. The audit takes the"
    " riskiest ceil({share:.0%} of n) rows, equal risks in ascending row id; because BF16"
    " margins are often exactly 0, many rows tie at the cut, so the catch expected under a"
    " random order of the tied rows is shown beside it, and a random audit would catch"
    " about {share:.0%}. Intervals: percentile row bootstrap, 20,000 seeded resamples,"
    " resamples without both classes dropped."
)


def _figure_roc(flip: FlipAnalysis, path: Path) -> Path | None:
    """ROC of every score, one panel per matrix section, for precisions with a defined AUC."""
    sections: dict[str, list[Any]] = {}
    for panel in flip.panels:
        if panel.undefined is None:
            sections.setdefault(panel.section, []).append(panel)
    if not sections:
        return None
    figure, axes = _new_figure(len(sections), height=4.2)
    for ax, (section, panels) in zip(axes, sections.items(), strict=True):
        ax.plot([0, 1], [0, 1], color="#999999", linewidth=0.8, linestyle=":", label="chance")
        for panel in panels:
            for colour, result in zip(SCORE_COLOURS, panel.results, strict=False):
                fpr, tpr = roc_points(result.risks, panel.labels)
                ax.plot(
                    fpr,
                    tpr,
                    color=colour,
                    linestyle="-" if panel.precision == "bf16" else "--",
                    linewidth=1.5,
                    label=f"{panel.precision} {result.score.name}: AUC {result.auc:.2f}",
                )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.set_aspect("equal")
        ax.set_xlabel("exact rows flagged (false positive rate)")
        ax.set_ylabel("divergent rows flagged (true positive rate)")
        ax.set_title(f"{section}: flip predictor ROC", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    return _save(figure, path)


def _flip_rows(flip: FlipAnalysis) -> list[tuple[str, ...]]:
    rows = []
    for panel in flip.panels:
        if panel.undefined:
            undefined = f"undefined: {panel.undefined}"
            head = (
                panel.section,
                panel.precision,
                "every score",
                f"{panel.divergent}/{panel.rows}",
            )
            rows.append((*head, undefined, str(panel.results[0].catch.audited), "—", "—"))
            continue
        for result in panel.results:
            auc, catch = result.auc, result.catch
            if auc is None or result.auc_ci is None:
                auc_text = "undefined"
            else:
                auc_text = f"{auc:.3f} [{result.auc_ci.low:.3f}, {result.auc_ci.high:.3f}]"
            if catch.share is None or result.catch_ci is None:
                caught = expected = "undefined (no row diverges)"
            else:
                low, high = 100 * result.catch_ci.low, 100 * result.catch_ci.high
                share = f"{100 * catch.share:.0f}% [{low:.0f}, {high:.0f}]"
                caught = f"{catch.caught}/{catch.divergent} ({share})"
                expected = f"{100 * catch.expected_if_ties_random / catch.divergent:.0f}%"
            rows.append(
                (
                    panel.section,
                    panel.precision,
                    result.score.name,
                    f"{panel.divergent}/{panel.rows}",
                    auc_text,
                    f"{catch.audited} ({catch.tied_at_cut} tied at cut)",
                    caught,
                    expected,
                )
            )
    return rows


def _flip_blocks(run_dir: Path, ledgers: dict[str, Ledger], figures: Path) -> list[Block]:
    """The flip predictor's table, ROC figure and method note; a plain note when skipped."""
    flip = analyze_flip(run_dir, ledgers)
    blocks: list[Block] = [Heading("Flip predictor: which rows will a rebuilt prefix change?")]
    if flip.skipped:
        return [*blocks, Paragraph(flip.skipped)]
    scores = "; ".join(f"`{s.name}` = {s.description}" for s in SCORES)
    blocks += [
        Paragraph(FLIP_METHOD_NOTE.format(scores=scores, primary=PRIMARY_SCORE, share=AUDIT_SHARE)),
        Table(
            (
                "section",
                "precision",
                "score",
                "divergent/rows",
                "AUC [bootstrap 95% CI]",
                "audited rows",
                "divergent caught [95% CI, %]",
                "caught if ties random",
            ),
            _flip_rows(flip),
        ),
    ]
    if figure := _figure_roc(flip, figures / "flip_predictor_roc.png"):
        blocks.append(
            Image(figure, "ROC of each margin score against suffix divergence; dashed: not bf16.")
        )
    else:
        blocks.append(Paragraph("No precision has both divergent and exact rows, so no ROC."))
    return blocks


RESAMPLE_METHOD_NOTE = (
    "Method. Each seed drove one sample from the live state and one from the prefill state"
    " of the same prefix, so seeds are paired; items are fixed and seeds are the random"
    " draws; alpha = 0.05. Paired: the share of seeds whose tokens changed (Wilson 95%)"
    " and exact McNemar on per-seed correctness. Accuracy change (prefill − live): mean"
    " over items, its standard error with half a pair added to each cell of every item's"
    " 2x2 table, equivalent (TOST) when the 90% interval lies inside ±margin. TV distance"
    " between the answer distributions (unparsed answers are one category): mean over"
    " items, percentile bootstrap of seed pairs within items (2,000 seeded resamples), and"
    " a permutation test that swaps each pair's answers. Its TOST upper bound is the"
    " smaller of a coupling bound (a seed's two samples share a random stream, so TV is at"
    " most the share of pairs whose answers differ: Wilson upper bound) and the bootstrap's"
    " upper percentile (used once 10 pairs' answers differ), each at alpha/2. Faithful:"
    " both TOSTs pass. Not faithful: the accuracy interval lies outside the margin, or the"
    " permutation test rejects equality and the TV interval lies above the margin."
    " Otherwise undecided, with the samples per item that would decide at power 0.8,"
    " projecting each bound with 1/sqrt(K) at the measured spread; a TV refutation is"
    " projected from the TV in excess of the permutation mean (the TV that equal"
    " distributions give at this K, far above zero for a wide answer distribution). The"
    " power table gives those samples per item for other margins."
)
RESAMPLE_OTHER = 6  # answers drawn per item panel before the rest are lumped as "other"


def _answer_counts(pairs: list[list[Any]]) -> dict[str, int]:
    return {"unparsed" if a is None else str(a): int(n) for a, n in pairs}


def _figure_resample(rows: Ledger, block: Json, precision: str, path: Path) -> Path:
    """Small multiples: each item's live vs prefill answer counts, then every item's TV
    and the pooled TV with its bootstrap interval."""
    panels = len(rows) + 1
    columns = min(6, panels)
    lines = -(-panels // columns)
    figure = Figure(figsize=(2.6 * columns, 2.3 * lines), layout="constrained")
    axes = list(figure.subplots(lines, columns, squeeze=False).flat)
    for i, ax in enumerate(axes[: len(rows)]):
        live = _answer_counts(rows["live_answer_distribution"][i])
        prefill = _answer_counts(rows["prefill_answer_distribution"][i])
        order = sorted(
            live.keys() | prefill.keys(), key=lambda a: -(live.get(a, 0) + prefill.get(a, 0))
        )
        shown, rest = order[:RESAMPLE_OTHER], order[RESAMPLE_OTHER:]
        labels = shown + (["other"] if rest else [])
        for offset, counts, colour, name in (
            (-0.2, live, "#7f8c8d", "live"),
            (0.2, prefill, "#16a085", "prefill"),
        ):
            heights = [counts.get(a, 0) for a in shown] + (
                [sum(counts.get(a, 0) for a in rest)] if rest else []
            )
            ax.bar(np.arange(len(labels)) + offset, heights, 0.4, color=colour, label=name)
        ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right", fontsize=6)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{rows.row_ids[i]} (TV {rows['tv_distance'][i]:.2f})", fontsize=8)
        if i == 0:
            ax.legend(fontsize=6)
    ax = axes[len(rows)]
    tv = block["tv_distance"]
    low, high = tv["bootstrap_95_ci"]
    ax.plot(
        np.zeros(len(rows)), rows["tv_distance"], "o", color="#bbbbbb", markersize=3, label="items"
    )
    # a percentile interval of the upward-biased plug-in TV may lie above the estimate
    ax.vlines(1, low, high, color="#34495e", label="pooled, 95% CI")
    ax.plot([1], [tv["estimate"]], "o", color="#34495e")
    ax.axhline(block["margin"], color="#c0392b", linewidth=0.8, linestyle="--", label="margin")
    ax.set_xticks([0, 1], ["per item", "pooled"], fontsize=7)
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{precision}: TV distance", fontsize=8)
    ax.legend(fontsize=6)
    for ax in axes[panels:]:
        ax.set_visible(False)
    return _save(figure, path)


def _estimate(value: float, interval: list[float], spec: str) -> str:
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _resample_rows(section: Json) -> list[tuple[str, ...]]:
    rows = []
    for precision, b in section.items():
        changed, tv, accuracy = (
            b["seeds_changed"],
            b["tv_distance"],
            b["accuracy_difference_prefill_minus_live"],
        )
        rows.append(
            (
                precision,
                f"{b['temperature']:g} / {b['top_p']:g}",
                f"{b['items']} × {b['samples_per_item']}",
                f"{changed['count']}/{changed['n']} {_percent_interval(changed)}",
                str(b["answers_changed"]),
                f"{b['mcnemar']['exact_two_sided_p']:.3g}",
                _estimate(accuracy["estimate"], accuracy["tost_90_ci"], "+.3f"),
                _estimate(tv["estimate"], tv["bootstrap_95_ci"], ".3f"),
                f"{tv['equal_distributions_mean']:.3f}",
                f"{tv['tost_upper_bound']:.3f}",
                f"{tv['permutation_p']:.3g}",
                b["verdict"],
            )
        )
    return rows


def _resample_blocks(claims: Json, ledgers: dict[str, Ledger], figures: Path) -> list[Block]:
    """The certificate first, one sentence per precision; then its evidence and method."""
    section = claims.get("resample")
    if not section or RESAMPLE_FILE not in ledgers:
        return []
    blocks: list[Block] = [Heading("Resample: is resampling from a rebuilt prefix faithful?")]
    blocks += [Paragraph(f"{precision}: {b['sentence']}") for precision, b in section.items()]
    blocks += [
        Table(
            (
                "precision",
                "temperature / top-p",
                "items × samples",
                "seeds changed [95% CI, %]",
                "answers changed",
                "McNemar p",
                "accuracy change [90% CI]",
                "TV [95% CI]",
                "TV if equal distributions",
                "TV upper bound",
                "permutation p",
                "verdict",
            ),
            _resample_rows(section),
        ),  # fmt: skip
        Paragraph(RESAMPLE_METHOD_NOTE),
        Table(
            ("precision", "margin", "samples per item: accuracy", "TV", "faithful verdict"),
            [
                (
                    precision,
                    f"{entry['margin']:g}",
                    *(
                        str(entry["samples_per_item"][k] or "—")
                        for k in ("accuracy", "tv", "faithful")
                    ),
                )
                for precision, b in section.items()
                for entry in b["power"]
            ],
        ),  # fmt: skip
    ]
    ledger = ledgers[RESAMPLE_FILE]
    for precision, b in section.items():
        rows = ledger.select(ledger["precision"] == precision)
        figure = _figure_resample(rows, b, precision, figures / f"resample_{precision}.png")
        blocks.append(
            Image(figure, f"{precision}: answer counts per item, live vs prefill; pooled TV.")
        )
    return blocks


def _manifest_rows(run_dir: Path) -> list[tuple[str, ...]]:
    """The facts a reader needs to judge a run: model, precision contract, machine, items."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return []
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        contract = manifest["contract"]
        model, env, run = contract["model_info"], contract["environment"], contract["run"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LedgerError("manifest.json", f"it is not a kvreplay run manifest ({error})") from None
    engines = {
        name: entry.get("engine", {}).get("engine", "?")
        for name, entry in manifest.get("experiments", {}).items()
    }
    return [
        ("model", f"{model['spec']} ({model['model_type']}, {model['num_layers']} layers)"),
        ("model digest", model["model_digest"]),
        ("stage plan", run["plan"]["name"] + ", boundary after " + run["plan"]["boundary_stage"]),
        (
            "items",
            f"{contract['items']['source']} ({contract['items']['count']} items, "
            f"digest {contract['items']['digest'][:16]}…)",
        ),
        ("device", f"{env['device']} ({env['device_name']}), {env['threads']} threads"),
        (
            "versions",
            f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}",
        ),
        ("dtype contract", json.dumps(env["dtype_contract"], sort_keys=True)),
        *(
            [
                (
                    "backend",
                    f"{run['backend']['name']} {env.get(run['backend']['name'], '?')}, "
                    + json.dumps(run["backend"], sort_keys=True),
                )
            ]
            if "backend" in run
            else []
        ),
        ("experiments", ", ".join(f"{k} ({v})" for k, v in engines.items())),
        ("kvreplay", f"{manifest.get('kvreplay_version')} at {manifest.get('git_commit') or '?'}"),
    ]


def _load_claims(run_dir: Path, ledgers: dict[str, Ledger], out_dir: Path) -> Json:
    """The run's claims.json, or a fresh analysis written to out_dir when there is none."""
    path = run_dir / "claims.json"
    if not path.is_file():
        claims = build_claims(ledgers)
        write_claims(claims, out_dir / "claims.json")
        return claims
    try:
        claims = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise LedgerError("claims.json", f"it is not valid JSON ({error})") from None
    if not isinstance(claims, dict) or claims.get("schema") != SCHEMA:
        raise LedgerError("claims.json", f"its schema is not {SCHEMA}", field="schema")
    return claims


def _blocks(run_dir: Path, claims: Json, ledgers: dict[str, Ledger], figures: Path) -> list[Block]:
    """The report's content, independent of its Markdown or HTML rendering."""
    blocks: list[Block] = [Heading(f"kvreplay report: {run_dir.resolve().name}")]
    manifest = _manifest_rows(run_dir)
    blocks.append(Heading("Run"))
    if manifest:
        blocks.append(Table(("field", "value"), manifest))
    else:
        blocks.append(Paragraph("No manifest.json here, so model, engine and device are unknown."))
    blocks.append(Paragraph("Ledgers read: " + ", ".join(sorted(ledgers)) + "."))

    blocks += [
        Heading("Headline, beside the paper"),
        Paragraph(
            "The paper column quotes the stage-replay paper's published figures"
            " (arXiv 2607.28495); a run on another model or item set is not expected to match."
        ),
        Table(("claim", "this run", "paper"), _headline_rows(claims)),
    ]

    matrix = list(matrix_blocks(claims))
    if matrix:
        blocks += [
            Heading("Disagreement rates (Wilson 95% intervals)"),
            Table(
                ("section", "precision", "endpoint", "count/n", "rate [95% CI, %]"),
                [
                    (d.section, p, label, _rate_text(b[key]), _percent_interval(b[key]))
                    for d, p, b in matrix
                    for key, label in ENDPOINTS
                ],
            ),
        ]
        if figure := _figure_disagreement(claims, figures / "disagreement_rates.png"):
            blocks.append(
                Image(figure, "Rows where prefill and the left arm disagree, by endpoint.")
            )
        extra = claims.get("extra", {})
        blocks += [
            Heading("Accuracy per arm"),
            Table(
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
                        _fraction(b[f"{d.left}_correct"], b["rows"]),
                        _fraction(b["prefill_correct"], b["rows"]),
                        f"{b['accuracy_delta_prefill_minus_left_pp']:+.1f}",
                        _interval(*b["accuracy_paired_bootstrap_95_ci_pp"]),
                        _interval(*newcombe)
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
        if figure := _figure_accuracy(claims, figures / "accuracy.png"):
            blocks.append(
                Image(
                    figure,
                    "Accuracy of each arm; prefill minus left with its paired bootstrap interval.",
                )
            )
        blocks.append(Heading("Where suffixes first diverge"))
        if figure := _figure_first_divergence(ledgers, figures / "first_divergence.png"):
            blocks.append(
                Image(figure, "First differing suffix token, over rows whose suffixes differ.")
            )
        else:
            blocks.append(Paragraph("No suffix diverged, so there is no histogram."))
        blocks.append(Heading("Cache drift by layer"))
        figure, note = _figure_layer_drift(ledgers, figures / "cache_drift_by_layer.png")
        blocks.append(Image(figure, note) if figure else Paragraph(note))

    transplants = list(_transplants(claims))
    if transplants:
        blocks += [
            Heading("Transplant recovery"),
            Table(
                ("panel", *(label for _, label in TRANSPLANT_RATES)),
                [
                    (name, *(_rate_text(b[key]) for key, _ in TRANSPLANT_RATES))
                    for name, b in transplants
                ],
            ),
        ]
        if figure := _figure_transplant(claims, figures / "transplant_recovery.png"):
            blocks.append(
                Image(
                    figure, "Donor recovery after swapping all K/V layers (Wilson 95% intervals)."
                )
            )
    blocks += _served_blocks(claims)
    blocks += _resample_blocks(claims, ledgers, figures)
    if matrix:
        blocks += _flip_blocks(run_dir, ledgers, figures)
    return blocks


SERVED_NOTE = (
    "These rows come from a serving engine, which exposes token ids and top-k logprobs but "
    "no K/V tensors. In the matched tables above, 'live' is a prefix-cache hit (the blocks "
    "of P written by the generation that reached P, prompt prefill and decode steps, reused; "
    "only the tail recomputed) and 'prefill' a miss (the cache reset, P prefilled in one "
    "shot); the integrity gate checks that every hit read all the full blocks its rewrite "
    "of P wrote and every miss none. A row can show whether the two continue differently, "
    "where, with what top-1/top-2 margin, and how many tokens the hit reused; it cannot "
    "show how the cached K/V differ, so the cache-exactness, drift and storage columns are "
    "empty and no transplant, bridge or localisation runs on this backend."
)


def _served_blocks(claims: Json) -> list[Block]:
    """What a served run adds: its controls and how much of P the hit reused."""
    section = claims.get("served_matched")
    if not section:
        return []
    rows = [
        (
            precision,
            f"{b['live_cached_tokens_median']:g} / {b['prefix_token_count_median']:g}",
            f"{b['prefill_cached_tokens_median']:g}",
            *(
                _rate_text(b[key]) if b[key]["n"] else "—"
                for key in (c.replace("_equal_", "_differs_from_") for c in SERVED_CONTROLS)
            ),
        )
        for precision, b in section.items()
    ]
    return [
        Heading("Serving engine: prefix-cache hit vs miss"),
        Paragraph(SERVED_NOTE),
        Table(
            (
                "precision",
                "hit cached tokens / P (median)",
                "miss cached tokens (median)",
                *(f"{label}: suffixes differ" for label in SERVED_CONTROLS.values()),
            ),
            rows,
        ),
    ]


def _markdown_table(table: Table) -> str:
    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join(
        [line(table.header), line(tuple("---" for _ in table.header)), *map(line, table.rows)]
    )


def _to_markdown(blocks: list[Block], out_dir: Path) -> str:
    parts = []
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            parts.append(("# " if i == 0 else "## ") + block.text)
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Table):
            parts.append(_markdown_table(block))
        else:
            parts.append(
                f"![{block.caption}]({block.path.relative_to(out_dir).as_posix()})\n\n*{block.caption}*"
            )
    return "\n\n".join(parts) + "\n"


HTML_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #222; line-height: 1.45; padding: 0 1rem; }
table { border-collapse: collapse; margin: 0.8rem 0 1.4rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
figure { margin: 0.8rem 0 1.6rem; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85rem; color: #555; }
code { background: #f4f4f4; padding: 0 0.2rem; }
"""


def _html_text(text: str) -> str:
    """Escape, then render the only inline markup the blocks use: `code`."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _to_html(blocks: list[Block]) -> str:
    body = []
    title = ""
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            title = title or block.text
            tag = "h1" if i == 0 else "h2"
            body.append(f"<{tag}>{_html_text(block.text)}</{tag}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_html_text(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_html_text(c)}</th>" for c in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{_html_text(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        else:
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            alt = html.escape(block.caption)
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">'
                f"<figcaption>{_html_text(block.caption)}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{HTML_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def build_report(run_dir: Path, out_dir: Path | None = None) -> ReportPaths:
    """Write report.md, report.html and figures/*.png for a run (or any folder of ledgers).

    out_dir defaults to run_dir; pass another folder when run_dir is read-only.
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    ledgers = load_ledger_dir(run_dir)
    figures = out_dir / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    claims = _load_claims(run_dir, ledgers, out_dir)
    blocks = _blocks(run_dir, claims, ledgers, figures)
    markdown, page = out_dir / "report.md", out_dir / "report.html"
    markdown.write_text(_to_markdown(blocks, out_dir), encoding="utf-8")
    page.write_text(_to_html(blocks), encoding="utf-8")
    images = tuple(block.path for block in blocks if isinstance(block, Image))
    return ReportPaths(markdown, page, images)
