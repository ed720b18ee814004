"""The localize section: which layers, and keys or values, carry a divergent trajectory.
From ``localize.csv`` (one line per probe of a divergent row), per direction: how many
rows each single layer recovers alone, each growing prefix ``[0, k)`` and suffix
``[k, L)`` of the layer stack, keys only and values only, and each row's minimal
sufficient window; its summary line, its report table per layer and its figure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvreplay.core.claims import key
from kvreplay.experiments.localize.table import LOCALIZE_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.harness.table import Ledger
from kvreplay.measure.rates import count, fraction
from kvreplay.render.document import Block, Heading, Image, Paragraph
from kvreplay.render.document import Table as Grid

if TYPE_CHECKING:
    from kvreplay.render.figures import Figures

SECTION = "localize"
SWEEP_AXES = {"single": "layer", "prefix": "layers", "suffix": "from_layer"}
"""Each sweep drawn over the layer stack, and what its x is: the one layer transplanted,
the count of layers from the bottom ([0, k)), the first layer of the top ([k, L))."""
COMPONENTS = {"keys_only": "k", "values_only": "v"}


@dataclass(frozen=True)
class Tally:
    """Divergent rows that recover the donor, of those probed."""

    recovered: int
    probed: int

    @property
    def cell(self) -> str:
        return fraction(self.recovered, self.probed)

    @property
    def rate(self) -> float:
        return self.recovered / self.probed


@dataclass(frozen=True)
class SweepPoint(Tally):
    """Recovery at one x of a sweep; claims.json names x as its sweep's axis."""

    x: int = field(metadata=key("{axis}"))


def _sweep_key(sweep: str) -> dict[str, object]:
    return key(context={"axis": SWEEP_AXES[sweep]})


@dataclass(frozen=True)
class Direction:
    """One direction of transplant (donor into recipient): each sweep in order of x,
    keys only and values only over all layers, and each row's minimal sufficient window."""

    single: list[SweepPoint] = field(metadata=_sweep_key("single"))
    prefix: list[SweepPoint] = field(metadata=_sweep_key("prefix"))
    suffix: list[SweepPoint] = field(metadata=_sweep_key("suffix"))
    keys_only: Tally
    values_only: Tally
    minimal_windows: dict[str, str]

    @property
    def all_layers(self) -> Tally:
        """The full transplant: the prefix sweep's last step, [0, L)."""
        return self.prefix[-1]


SWEEPS: dict[str, Callable[[Direction], list[SweepPoint]]] = {
    "single": lambda d: d.single,
    "prefix": lambda d: d.prefix,
    "suffix": lambda d: d.suffix,
}
PARTS: tuple[Callable[[Direction], Tally], ...] = (lambda d: d.keys_only, lambda d: d.values_only)
"""The components the figure draws beside the full transplant, in COMPONENTS order."""


@dataclass(frozen=True)
class Localize:
    """The localize claims of one run's probes."""

    precision: str
    num_layers: int
    rows: int
    directions: dict[str, Direction]


@dataclass(frozen=True)
class LocalizeClaims:
    localize: Localize = field(metadata=key(SECTION))


def _tally(probes: Ledger) -> Tally:
    return Tally(count(probes["recovers_donor"]), len(probes))


def _sweep(probes: Ledger, sweep: str, num_layers: int) -> list[SweepPoint]:
    """Recovery at each x of one sweep, in order of x."""
    rows = probes.select((probes["sweep"] == sweep) & (probes["component"] == "kv"))
    if sweep == "single":
        xs = np.array([int(layer) for layer in rows["layers"]])
    elif sweep == "prefix":
        xs = rows["layer_count"]
    else:
        xs = num_layers - rows["layer_count"]
    return [
        SweepPoint(**vars(_tally(rows.select(xs == x))), x=int(x)) for x in sorted(set(xs.tolist()))
    ]


def recovery(ledger: Ledger) -> Localize:
    """The localize claims of one run's probes."""
    num_layers = int(ledger["num_layers"][0])
    directions = {}
    for direction in sorted(set(ledger["direction"].tolist())):
        probes = ledger.select(ledger["direction"] == direction)
        minimal = probes.select(probes["sweep"] == "minimal")
        directions[direction] = Direction(
            **{sweep: _sweep(probes, sweep, num_layers) for sweep in SWEEP_AXES},
            **{
                name: _tally(probes.select(probes["component"] == component))
                for name, component in COMPONENTS.items()
            },
            minimal_windows=dict(
                zip(minimal.row_ids.tolist(), minimal["layers"].tolist(), strict=True)
            ),
        )
    return Localize(
        precision=str(ledger["precision"][0]),
        num_layers=num_layers,
        rows=len(set(ledger.row_ids.tolist())),
        directions=directions,
    )


def _claims(reading: Reading) -> LocalizeClaims:
    (ledger,) = reading.ledgers.values()
    return LocalizeClaims(recovery(ledger))


def _summary(claims: LocalizeClaims) -> list[str]:
    section = claims.localize
    lines = []
    for name, d in section.directions.items():
        full, alone = d.all_layers, max(d.single, key=lambda p: p.recovered)
        lines.append(
            f"localize {section.precision} {name}: all {section.num_layers} layers recover"
            f" the donor on {full.cell} divergent rows, one layer alone on at most"
            f" {alone.cell} (layer {alone.x}); keys only {d.keys_only.cell}, values only"
            f" {d.values_only.cell}"
        )
    return lines


METHOD_NOTE = (
    "Method. On each divergent row of a prior run, one replay and one prefill state are"
    " built, and subsets of the donor's K/V (the first name of a direction) are"
    " transplanted into the recipient and decoded against the donor's suffix; a probe"
    " recovers the donor when it reproduces the donor's suffix token for token. Per layer"
    " i of L: the layer alone, the layers below it with it ([0, i+1)), and the layers from"
    " it up ([i, L)); then keys only and values only, all layers; and a deterministic"
    " bisection for a small contiguous window that suffices where the full transplant"
    " recovers. Each cell counts the divergent rows that recover of those probed."
)


def _report(page: Page[LocalizeClaims]) -> list[Block]:
    section = page.claims.localize
    if not page.ledgers:
        return []
    directions = section.directions
    per_layer = [
        (name, str(i), alone.cell, below.cell, above.cell)
        for name, d in directions.items()
        for i, (alone, below, above) in enumerate(zip(d.single, d.prefix, d.suffix, strict=True))
    ]
    components = [
        (
            name,
            d.all_layers.cell,
            d.keys_only.cell,
            d.values_only.cell,
            ", ".join(f"{row}: {window}" for row, window in d.minimal_windows.items()) or "—",
        )
        for name, d in directions.items()
    ]
    rows = f"{section.rows} divergent rows, {section.precision}, {section.num_layers}"
    return [
        Heading("Localize: which layers carry a divergent trajectory?"),
        Paragraph(f"{METHOD_NOTE} This run: {rows} layers."),
        Grid(("direction", "layer i", "alone", "layers [0, i+1)", "layers [i, L)"), per_layer),
        Grid(
            ("direction", "K and V, all layers", "K only", "V only", "minimal window per row"),
            components,
        ),
        Image(draw(directions, page.figures), "Rows recovering the donor, by layer set."),
    ]


def draw(directions: dict[str, Direction], figures: Figures) -> Path:
    """Four panels: single layers, growing prefixes, growing suffixes, K vs V vs both;
    saved as the experiment first drew it after each run (with matplotlib's Software
    stamp), so committed runs re-derive byte for byte."""
    names = sorted(directions)
    figure = figures.new(16, 3.8)
    axes = figure.subplots(1, 4, sharey=True)
    panels = (
        ("single", "transplanted layer i alone", "layer i"),
        ("prefix", "layers [0, k) transplanted", "k (layers from the bottom)"),
        ("suffix", "layers [k, L) transplanted", "k (first transplanted layer)"),
    )
    for ax, (sweep, title, xlabel) in zip(axes, panels, strict=False):
        for name in names:
            if points := SWEEPS[sweep](directions[name]):
                xs = [point.x for point in points]
                ax.plot(xs, [100 * p.rate for p in points], marker="o", markersize=3, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        figures.integer_ticks(ax.xaxis)
    width = 0.8 / max(len(names), 1)
    for offset, name in enumerate(names):
        d = directions[name]
        full = [d.all_layers.rate] if d.prefix else [0.0]
        values = full + [part(d).rate if part(d).probed else 0.0 for part in PARTS]
        positions = [i + offset * width for i in range(3)]
        axes[3].bar(positions, [100 * v for v in values], width=width, label=name)
    axes[3].set_xticks([i + width * (len(names) - 1) / 2 for i in range(3)])
    axes[3].set_xticklabels(["K and V", "K only", "V only"])
    axes[3].set_title("all layers, by component", fontsize=10)
    axes[0].set_ylabel("divergent rows recovering the donor (%)")
    axes[0].set_ylim(-5, 105)
    if names:
        axes[0].legend(fontsize=8)
    else:
        figure.suptitle("no divergent rows: nothing to localize")
    return figures.write(figure, "localize.png")


LOCALIZE = Section(
    "localize", (LOCALIZE_TABLE,), LocalizeClaims, _claims, _summary, report=_report,
    paper_order=8,
)  # fmt: skip
