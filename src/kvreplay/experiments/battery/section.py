"""The battery section: per precision and request shape, on how many items the shape's
hit parted from its miss at the shape's level (a detection), how many it was exercised
on, and beside them the paper's question inside the engine: on how many items the hit at
a random cut continued as the live decode it cut."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.core.claims import key
from kvreplay.experiments.battery.table import BATTERY, BATTERY_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Rate
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid


@dataclass(frozen=True)
class ShapeClaims:
    """One request shape at one precision: its level, the items it was exercised on and
    those where it parted hit from miss."""

    level: str
    exercised: int
    detected: Rate


@dataclass(frozen=True)
class BatteryPrecision:
    """One precision: the backend, the live decode against the hit at a random cut, and
    each shape (keyed by its name beside the other two)."""

    backend: str
    live_equal: Rate
    shapes: dict[str, ShapeClaims] = field(metadata=key(flatten=True))


@dataclass(frozen=True)
class BatteryClaims:
    precisions: dict[str, BatteryPrecision] = field(metadata=key(BATTERY))


def _claims(reading: Reading) -> BatteryClaims:
    (ledger,) = reading.ledgers.values()
    found = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        shapes = {}
        for shape in dict.fromkeys(rows["shape"].tolist()):
            mine = rows.select(rows["shape"] == shape)
            ran = [e is not False for e in mine["exercised"]]
            detected = sum(bool(d) for d, r in zip(mine["detected"], ran, strict=True) if r)
            shapes[shape] = ShapeClaims(
                str(mine["level"][0]), sum(ran), Rate.of(detected, sum(ran), MATRIX_WILSON_Z)
            )
        live = [bool(v) for v in rows["live_equal"] if v is not None]
        found[precision] = BatteryPrecision(
            str(rows["backend"][0]), Rate.of(sum(live), len(live), MATRIX_WILSON_Z), shapes
        )
    return BatteryClaims(found)


def _summary(claims: BatteryClaims) -> list[str]:
    return [
        f"{BATTERY} {precision}: detections "
        + ", ".join(f"{name} {s.detected.text}" for name, s in p.shapes.items())
        + f"; live decode equals the hit at a cut {p.live_equal.text}"
        for precision, p in claims.precisions.items()
    ]


NOTE = (
    "Each request shape puts the engine through one history before a prefix-cache hit "
    "of the item's prompt and compares it with a miss of the same prompt, at the shape's "
    "level (bit for bit at the reported log-probabilities where the clean engine is "
    "measured exact, else tokens). A detection is a hit that parts from its miss there, "
    "or a hit or miss that read other cached tokens than its history wrote. Beside them, "
    "the paper's question: the hit at a random cut of a greedy continuation against the "
    "live decode it cut."
)


def _report(page: Page[BatteryClaims]) -> list[Block]:
    precisions = page.claims.precisions
    if not precisions:
        return []
    rows = [
        (precision, name, s.level, str(s.exercised), s.detected.text)
        for precision, p in precisions.items()
        for name, s in p.shapes.items()
    ]
    return [
        Heading("Battery: the request shapes against their misses"),
        Paragraph(NOTE),
        Grid(("precision", "shape", "level", "exercised on", "detected"), rows),
    ]


SECTION = Section(BATTERY, (BATTERY_TABLE,), BatteryClaims, _claims, _summary, report=_report)
