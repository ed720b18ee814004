"""The resample section: the certificate (is resampling from a rebuilt prefix faithful?)
of each precision, pooled over its items and per item; its sentence per precision, the
evidence and the method in the report, and each item's answer counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvreplay.core.claims import key
from kvreplay.experiments.resample.table import RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.harness.table import Ledger
from kvreplay.measure.certificate import CertificateClaims, PairedSamples, Power, certify
from kvreplay.render.document import Block, Heading, Image, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "resample"
OTHER_AFTER = 6  # answers drawn per item panel before the rest are lumped as "other"


@dataclass(frozen=True)
class ResamplePrecision(CertificateClaims):
    """One precision's certificate, pooled over its items, the sampler that drew them,
    and each item's own certificate."""

    temperature: float = 0.0
    top_p: float = 1.0
    per_item: dict[str, CertificateClaims] = field(default_factory=dict)


@dataclass(frozen=True)
class ResampleClaims:
    precisions: dict[str, ResamplePrecision] = field(metadata=key(SECTION))


def paired_samples(rows: Ledger) -> list[PairedSamples]:
    """Each resample row's seeds as the certificate's paired samples."""
    return [
        PairedSamples(
            item=str(rows.row_ids[i]),
            live=tuple(rows["live_answers"][i]),
            prefill=tuple(rows["prefill_answers"][i]),
            live_correct=tuple(rows["live_correct"][i]),
            prefill_correct=tuple(rows["prefill_correct"][i]),
            changed=tuple(index is not None for index in rows["first_divergence_indices"][i]),
        )
        for i in range(len(rows))
    ]


def _claims(reading: Reading) -> ResampleClaims:
    """The resample certificate of each precision, pooled over its items and per item."""
    (ledger,) = reading.ledgers.values()
    margin = float(ledger["margin"][0])
    found = {}
    for precision in dict.fromkeys(ledger["precision"].tolist()):
        rows = ledger.select(ledger["precision"] == precision)
        items = paired_samples(rows)
        found[precision] = ResamplePrecision(
            **vars(certify(items, margin).claims()),
            temperature=float(rows["temperature"][0]),
            top_p=float(rows["top_p"][0]),
            per_item={item.item: certify([item], margin).claims() for item in items},
        )
    return ResampleClaims(found)


def _summary(claims: ResampleClaims) -> list[str]:
    return [f"resample {p}: {block.sentence}" for p, block in claims.precisions.items()]


METHOD_NOTE = (
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


def _estimate(value: float, interval: tuple[float, float], spec: str) -> str:
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _rows(precisions: dict[str, ResamplePrecision]) -> list[tuple[str, ...]]:
    rows = []
    for precision, b in precisions.items():
        changed, tv, accuracy = (
            b.seeds_changed,
            b.tv_distance,
            b.accuracy_difference_prefill_minus_live,
        )
        rows.append(
            (
                precision,
                f"{b.temperature:g} / {b.top_p:g}",
                f"{b.items} × {b.samples_per_item}",
                f"{changed.count}/{changed.n} {changed.percent}",
                str(b.answers_changed),
                f"{b.mcnemar.exact_two_sided_p:.3g}",
                _estimate(accuracy.estimate, accuracy.tost_90_ci, "+.3f"),
                _estimate(tv.estimate, tv.bootstrap_95_ci, ".3f"),
                f"{tv.equal_distributions_mean:.3f}",
                f"{tv.tost_upper_bound:.3f}",
                f"{tv.permutation_p:.3g}",
                b.verdict,
            )
        )
    return rows


def _power_row(precision: str, entry: Power) -> tuple[str, ...]:
    needed = entry.samples_per_item
    counts = (needed.accuracy, needed.tv, needed.faithful)
    return (precision, f"{entry.margin:g}", *(str(k or "—") for k in counts))


def _report(page: Page[ResampleClaims]) -> list[Block]:
    """The certificate first, one sentence per precision; then its evidence and method."""
    precisions = page.claims.precisions
    if not precisions or not page.ledgers:
        return []
    blocks: list[Block] = [Heading("Resample: is resampling from a rebuilt prefix faithful?")]
    blocks += [Paragraph(f"{precision}: {b.sentence}") for precision, b in precisions.items()]
    blocks += [
        Grid(
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
            _rows(precisions),
        ),  # fmt: skip
        Paragraph(METHOD_NOTE),
        Grid(
            ("precision", "margin", "samples per item: accuracy", "TV", "faithful verdict"),
            [_power_row(p, entry) for p, b in precisions.items() for entry in b.power],
        ),
    ]
    (ledger,) = page.ledgers.values()
    for precision, b in precisions.items():
        rows = ledger.select(ledger["precision"] == precision)
        figure = _figure(page, rows, b, precision)
        blocks.append(
            Image(figure, f"{precision}: answer counts per item, live vs prefill; pooled TV.")
        )
    return blocks


def _answer_counts(pairs: list[list[Any]]) -> dict[str, int]:
    return {"unparsed" if a is None else str(a): int(n) for a, n in pairs}


def answer_order(live: dict[str, int], prefill: dict[str, int]) -> list[str]:
    """Answers by pooled count, ties by text: a set's order changes with the process's
    hash seed, and the figure's bytes must not."""
    return sorted(
        live.keys() | prefill.keys(), key=lambda a: (-(live.get(a, 0) + prefill.get(a, 0)), a)
    )


def _figure(
    page: Page[ResampleClaims], rows: Ledger, block: ResamplePrecision, precision: str
) -> Path:
    """Small multiples: each item's live vs prefill answer counts, then every item's TV
    and the pooled TV with its bootstrap interval."""
    panels = len(rows) + 1
    columns = min(6, panels)
    lines = -(-panels // columns)
    figure = page.figures.new(2.6 * columns, 2.3 * lines)
    axes = list(figure.subplots(lines, columns, squeeze=False).flat)
    for i, ax in enumerate(axes[: len(rows)]):
        live = _answer_counts(rows["live_answer_distribution"][i])
        prefill = _answer_counts(rows["prefill_answer_distribution"][i])
        order = answer_order(live, prefill)
        shown, rest = order[:OTHER_AFTER], order[OTHER_AFTER:]
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
        page.figures.integer_ticks(ax.yaxis)
        ax.set_title(f"{rows.row_ids[i]} (TV {rows['tv_distance'][i]:.2f})", fontsize=8)
        if i == 0:
            ax.legend(fontsize=6)
    ax = axes[len(rows)]
    tv = block.tv_distance
    low, high = tv.bootstrap_95_ci
    ax.plot(
        np.zeros(len(rows)), rows["tv_distance"], "o", color="#bbbbbb", markersize=3, label="items"
    )
    # a percentile interval of the upward-biased plug-in TV may lie above the estimate
    ax.vlines(1, low, high, color="#34495e", label="pooled, 95% CI")
    ax.plot([1], [tv.estimate], "o", color="#34495e")
    ax.axhline(block.margin, color="#c0392b", linewidth=0.8, linestyle="--", label="margin")
    ax.set_xticks([0, 1], ["per item", "pooled"], fontsize=7)
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{precision}: TV distance", fontsize=8)
    ax.legend(fontsize=6)
    for ax in axes[panels:]:
        ax.set_visible(False)
    return page.figures.save(figure, f"resample_{precision}.png")


RESAMPLE = Section(
    "resample",
    (RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE),
    ResampleClaims,
    _claims,
    _summary,
    report=_report,
    paper_order=7,
)
