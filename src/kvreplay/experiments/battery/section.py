"""The battery section: per precision and request shape, on how many items the shape's
hit parted from its miss at the shape's level (a detection), how many it was exercised
on, and beside them the paper's question inside the engine: on how many items the hit at
a random cut continued as the live decode it cut."""

from __future__ import annotations

from kvreplay.experiments.battery.table import BATTERY, BATTERY_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Json, rate_payload, rate_text
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid


def _claims(reading: Reading) -> Json:
    (ledger,) = reading.ledgers.values()
    section: Json = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        block: Json = {"backend": str(rows["backend"][0])}
        for shape in dict.fromkeys(rows["shape"].tolist()):
            mine = rows.select(rows["shape"] == shape)
            ran = [e is not False for e in mine["exercised"]]
            detected = sum(bool(d) for d, r in zip(mine["detected"], ran, strict=True) if r)
            block[shape] = {
                "level": str(mine["level"][0]),
                "exercised": sum(ran),
                "detected": rate_payload(detected, sum(ran), MATRIX_WILSON_Z),
            }
        live = [bool(v) for v in rows["live_equal"] if v is not None]
        block["live_equal"] = rate_payload(sum(live), len(live), MATRIX_WILSON_Z)
        section[precision] = block
    return {BATTERY: section}


def _shapes(block: Json) -> list[str]:
    return [k for k in block if k not in ("backend", "live_equal")]


def _summary(claims: Json) -> list[str]:
    return [
        f"{BATTERY} {precision}: detections "
        + ", ".join(f"{s} {rate_text(b[s]['detected'])}" for s in _shapes(b))
        + f"; live decode equals the hit at a cut {rate_text(b['live_equal'])}"
        for precision, b in claims.get(BATTERY, {}).items()
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


def _report(page: Page) -> list[Block]:
    section = page.claims.get(BATTERY)
    if not section:
        return []
    rows = [
        (precision, shape, b[shape]["level"], str(b[shape]["exercised"]),
         rate_text(b[shape]["detected"]))
        for precision, b in section.items()
        for shape in _shapes(b)
    ]  # fmt: skip
    return [
        Heading("Battery: the request shapes against their misses"),
        Paragraph(NOTE),
        Grid(("precision", "shape", "level", "exercised on", "detected"), rows),
    ]


SECTION = Section(BATTERY, (BATTERY_TABLE,), _claims, _summary, report=_report)
