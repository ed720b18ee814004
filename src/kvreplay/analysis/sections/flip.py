"""The flip predictor's section: which rows of a run it ranks (each matrix panel's, as
in its CSV, with the left arm's margins from rows.jsonl and the CSV's suffix divergence
as the label), its claims under ``extra.flip_predictor``, its summary lines, and its
report table and ROC. The report reads every number from the claims; it recomputes only
the cheap risks the ROC draws, never the bootstrap."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvreplay.analysis.flip import (
    AUDIT_SHARE,
    FLIP_STREAM_BASE,
    PRIMARY_SCORE,
    SCORES,
    FlipAnalysis,
    FlipPredictor,
    PanelClaims,
    id_ranks,
    roc_points,
    row_risks,
    score_panel,
)
from kvreplay.core.claims import key
from kvreplay.experiments.matrix.section import MATRIX, MATRIX_DESIGNS
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.harness.table import Ledger
from kvreplay.ledger import Record
from kvreplay.render.document import Block, Heading, Image, Paragraph
from kvreplay.render.document import Table as Grid

SKIP_NO_ROWS = (
    "The flip predictor needs the live margins in rows.jsonl; this folder holds CSV"
    " ledgers only, so the section is skipped."
)
SKIP_NO_MARGINS = (
    "rows.jsonl holds no left-arm top-2 margins for {row} (a ledger written before kvreplay"
    " kept them, or in another layout), so the flip predictor is skipped."
)
SCORE_COLOURS = ("#8e44ad", "#d35400", "#27ae60")


@dataclass(frozen=True, eq=False)
class PanelRows:
    """One (matrix section, precision) panel as the predictor reads it: its rows of the
    CSV (their places, not a copy of their ids), each row's risks (a column per score,
    from its left-arm margins) and its stream; its suffix-divergence labels when asked."""

    section: str
    precision: str
    rows: Ledger
    risks: np.ndarray
    stream: int

    @property
    def labels(self) -> np.ndarray:
        return ~self.rows["suffix_equal"]


def _left_margins(data: dict[str, Any]) -> list[float] | None:
    """The left arm's decoded-step margins, stage after stage (forced openers have none);
    None when the row does not hold them where this version writes them."""
    try:
        segments = data["arms"]["left"]["suffix"]["segments"]
        return [float(m) for segment in segments for m in segment["margins"]]
    except (KeyError, TypeError, ValueError):
        return None


def panel_rows(
    runs: Iterable[Record] | None, ledgers: Mapping[str, Ledger]
) -> tuple[list[PanelRows], str | None]:
    """Every matrix panel of a run (``runs``: its rows; None: a folder of CSVs alone),
    rows as in the CSV, so counts match the claims; or none, and why it is skipped."""
    if runs is None:
        return [], SKIP_NO_ROWS
    panels: dict[tuple[str, str], PanelRows] = {}
    for index, design in enumerate(MATRIX_DESIGNS):
        if (ledger := ledgers.get(design.table.file)) is None:
            continue
        for offset, precision in enumerate(sorted(dict.fromkeys(ledger["precision"].tolist()))):
            rows = ledger.select(ledger["precision"] == precision)
            risks = np.empty((len(rows), len(SCORES)), order="F")  # a score's: contiguous
            stream = FLIP_STREAM_BASE + 10 * index + offset
            panels[(str(design.table.experiment), precision)] = PanelRows(
                design.section, precision, rows, risks, stream
            )
    if (missing := _fill_risks(runs, panels)) is not None:
        return [], SKIP_NO_MARGINS.format(row=missing)
    return [replace(panel, risks=_narrowed(panel.risks)) for panel in panels.values()], None


def _narrowed(risks: np.ndarray) -> np.ndarray:
    """The risks in four bytes each where every one of them is exact in four (a BF16 or
    FP32 margin is): the same numbers, every rank and tie the same, in half the memory."""
    narrow = risks.astype(np.float32)
    return narrow if np.array_equal(narrow, risks) else risks


def _fill_risks(records: Iterable[Record], panels: dict[tuple[str, str], PanelRows]) -> str | None:
    """Each panel row's risks, from its row's left-arm margins, in one pass over the rows.
    A panel's CSV lines are its completed rows in ledger order (analysis checked that the
    CSV derives from rows.jsonl), so a cursor per panel pairs them: all the predictor
    keeps of a row is a few doubles, so its memory does not grow with the suffixes'
    length, nor by a key for every row. The first panel row without margins (its key),
    or None."""
    filled = dict.fromkeys(panels, 0)
    for r in records:
        at = (r.experiment, r.data.get("precision"))
        if at not in panels or r.data.get("status") != "ok" or r.data.get("kind") == "prefix":
            continue
        panel, i = panels[at], filled[at]  # type: ignore[index]
        if i == len(panel.rows) or r.data["item_id"] != panel.rows.row_id(i):
            continue  # a row the CSV leaves out (an item unreached at another precision)
        if (margins := _left_margins(r.data)) is None:
            return f"{r.experiment}/{panel.rows.row_id(i)}/{panel.precision}"
        panel.risks[i] = row_risks(margins)
        filled[at] = i + 1  # type: ignore[index]
    for (experiment, precision), panel in panels.items():
        if (i := filled[(experiment, precision)]) < len(panel.rows):
            return f"{experiment}/{panel.rows.row_id(i)}/{precision}"
    return None


def analyze_flip(runs: Iterable[Record] | None, ledgers: Mapping[str, Ledger]) -> FlipAnalysis:
    """The predictor on every matrix panel of a run, with its bootstrap intervals."""
    panels, skipped = panel_rows(runs, ledgers)
    if skipped:
        return FlipAnalysis(skipped=skipped)
    return FlipAnalysis(
        tuple(
            score_panel(
                p.section, p.precision, id_ranks(p.rows.row_ids), p.risks, p.labels, p.stream
            )
            for p in panels
        )
    )


@dataclass(frozen=True)
class FlipClaims:
    flip_predictor: FlipPredictor = field(metadata=key(extra=True))


def _claims(reading: Reading) -> FlipClaims:
    return FlipClaims(analyze_flip(reading.records, reading.ledgers).claims())


def _panels(flip: FlipPredictor) -> Iterator[tuple[str, str, PanelClaims]]:
    """(section, precision, panel claims) in the order the predictor ran them."""
    for design in MATRIX_DESIGNS:
        for precision, panel in sorted(flip.panels.get(design.section, {}).items()):
            yield design.section, precision, panel


def _summary(claims: FlipClaims) -> list[str]:
    """One line per panel with the primary score's AUC and audit catch."""
    flip = claims.flip_predictor
    if flip.method is None:
        return [f"flip_predictor: {flip.note}"]
    lines = []
    for section, precision, panel in _panels(flip):
        divergent = f"{panel.divergent_rows}/{panel.rows} divergent"
        head = f"flip_predictor {section} {precision} ({divergent})"
        result = panel.scores[flip.method.primary_score]
        if result.auc is None or result.auc_bootstrap_95_ci is None:
            lines.append(f"{head}: AUC {panel.auc_status}")
            continue
        low, high = result.auc_bootstrap_95_ci
        audit = result.audit_top_share
        lines.append(
            f"{head}: {flip.method.primary_score} AUC {result.auc:.3f}"
            f" [{low:.3f}, {high:.3f}]; riskiest {audit.audited_rows} rows catch"
            f" {audit.divergent_caught}/{panel.divergent_rows}"
            f" ({audit.rows_tied_at_cut} tied at the cut)"
        )
    return lines


METHOD_NOTE = (
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


def _rows(flip: FlipPredictor) -> list[tuple[str, ...]]:
    rows = []
    for section, precision, panel in _panels(flip):
        head = (section, precision)
        divergent = f"{panel.divergent_rows}/{panel.rows}"
        if not panel.defined:
            audited = str(panel.scores[SCORES[0].name].audit_top_share.audited_rows)
            rows.append((*head, "every score", divergent, panel.auc_status, audited, "—", "—"))
            continue
        for score in SCORES:
            result = panel.scores[score.name]
            audit = result.audit_top_share
            if result.auc is None or result.auc_bootstrap_95_ci is None:
                auc = "undefined"
            else:
                low, high = result.auc_bootstrap_95_ci
                auc = f"{result.auc:.3f} [{low:.3f}, {high:.3f}]"
            if audit.share_of_divergent is None or audit.bootstrap_95_ci is None:
                caught = expected = "undefined (no row diverges)"
            else:
                low, high = (100 * bound for bound in audit.bootstrap_95_ci)
                share = f"{100 * audit.share_of_divergent:.0f}% [{low:.0f}, {high:.0f}]"
                caught = f"{audit.divergent_caught}/{panel.divergent_rows} ({share})"
                expected = f"{100 * (audit.share_expected_if_ties_random or 0):.0f}%"
            audited = f"{audit.audited_rows} ({audit.rows_tied_at_cut} tied at cut)"
            rows.append((*head, score.name, divergent, auc, audited, caught, expected))
    return rows


def _report(page: Page[FlipClaims]) -> list[Block]:
    """The predictor's table, ROC figure and method note; a plain note when skipped."""
    flip = page.claims.flip_predictor
    blocks: list[Block] = [Heading("Flip predictor: which rows will a rebuilt prefix change?")]
    if flip.method is None:
        return [*blocks, Paragraph(flip.note or "")]
    scores = "; ".join(f"`{s.name}` = {s.description}" for s in SCORES)
    blocks += [
        Paragraph(METHOD_NOTE.format(scores=scores, primary=PRIMARY_SCORE, share=AUDIT_SHARE)),
        Grid(
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
            _rows(flip),
        ),
    ]
    if figure := _figure_roc(page, flip):
        blocks.append(
            Image(figure, "ROC of each margin score against suffix divergence; dashed: not bf16.")
        )
    else:
        blocks.append(Paragraph("No precision has both divergent and exact rows, so no ROC."))
    return blocks


def _figure_roc(page: Page[FlipClaims], flip: FlipPredictor) -> Path | None:
    """ROC of every score, one panel per matrix section, for precisions with a defined
    AUC: the curve from each row's risk, the AUC from the claims."""
    defined = {
        (section, precision): panel for section, precision, panel in _panels(flip) if panel.defined
    }
    sections: dict[str, list[PanelRows]] = {}
    for panel in panel_rows(page.records, page.ledgers)[0]:
        if (panel.section, panel.precision) in defined:
            sections.setdefault(panel.section, []).append(panel)
    if not sections:
        return None
    figure, axes = page.figures.panels(len(sections), height=4.2)
    for ax, (section, rows) in zip(axes, sections.items(), strict=True):
        ax.plot([0, 1], [0, 1], color="#999999", linewidth=0.8, linestyle=":", label="chance")
        for panel in rows:
            results, labels = defined[(section, panel.precision)].scores, panel.labels
            for column, (colour, score) in enumerate(zip(SCORE_COLOURS, SCORES, strict=False)):
                fpr, tpr = roc_points(np.ascontiguousarray(panel.risks[:, column]), labels)
                ax.plot(
                    fpr,
                    tpr,
                    color=colour,
                    linestyle="-" if panel.precision == "bf16" else "--",
                    linewidth=1.5,
                    label=f"{panel.precision} {score.name}: AUC {results[score.name].auc:.2f}",
                )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.set_aspect("equal")
        ax.set_xlabel("exact rows flagged (false positive rate)")
        ax.set_ylabel("divergent rows flagged (true positive rate)")
        ax.set_title(f"{section}: flip predictor ROC", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    return page.figures.save(figure, "flip_predictor_roc.png")


FLIP = Section("flip", MATRIX.tables, FlipClaims, _claims, _summary, report=_report, paper_order=9)
