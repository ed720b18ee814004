"""The report's figures, drawn with matplotlib's Agg renderer straight onto a Figure
(no pyplot, so no GUI backend and no global state) and saved as PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvreplay.analysis.claims import (
    MATRIX_DESIGNS,
    Json,
    matrix_blocks,
    rate_text,
    transplant_panels,
)
from kvreplay.analysis.flip import FlipAnalysis, roc_points
from kvreplay.analysis.ledgers import LAYER_DRIFT_COLUMN, Ledger
from kvreplay.report.vocabulary import ENDPOINTS, TRANSPLANT_RATES

PRECISION_COLOURS = {"bf16": "#c0392b", "fp32": "#2471a3"}
SCORE_COLOURS = ("#8e44ad", "#d35400", "#27ae60")
RESAMPLE_OTHER = 6  # answers drawn per item panel before the rest are lumped as "other"


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
                rate_text(payload),
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


def figure_disagreement(claims: Json, path: Path) -> Path | None:
    """One panel per matrix section: each endpoint's disagreement rate, per precision."""
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


def figure_accuracy(claims: Json, path: Path) -> Path | None:
    """Accuracy of each arm beside prefill minus left with its paired bootstrap interval."""
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


def figure_first_divergence(ledgers: dict[str, Ledger], path: Path) -> Path | None:
    """Histogram of the first differing suffix token, over rows whose suffixes differ."""
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


def figure_layer_drift(ledgers: dict[str, Ledger], path: Path) -> tuple[Path | None, str]:
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


def figure_transplant(claims: Json, path: Path) -> Path | None:
    """Every transplant panel's recovery rates, side by side."""
    transplants = list(transplant_panels(claims))
    if not transplants:
        return None
    figure, (ax,) = _new_figure(1, height=4.0)
    figure.set_figwidth(max(6.0, 2.2 * len(TRANSPLANT_RATES)))
    series = {name: [block[key] for key, _ in TRANSPLANT_RATES] for name, block in transplants}
    _rate_bars(ax, [label for _, label in TRANSPLANT_RATES], series, "rows (%)")
    ax.set_title("whole-cache transplant: recipient follows the cache donor", fontsize=10)
    return _save(figure, path)


def figure_roc(flip: FlipAnalysis, path: Path) -> Path | None:
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


def _answer_counts(pairs: list[list[Any]]) -> dict[str, int]:
    return {"unparsed" if a is None else str(a): int(n) for a, n in pairs}


def answer_order(live: dict[str, int], prefill: dict[str, int]) -> list[str]:
    """Answers by pooled count, ties by text: a set's order changes with the process's
    hash seed, and the figure's bytes must not."""
    return sorted(
        live.keys() | prefill.keys(), key=lambda a: (-(live.get(a, 0) + prefill.get(a, 0)), a)
    )


def figure_resample(rows: Ledger, block: Json, precision: str, path: Path) -> Path:
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
        order = answer_order(live, prefill)
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
