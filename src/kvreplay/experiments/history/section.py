"""The history section: whether the same prefix-cache hit continues differently when P's
blocks were written by another history (a warm prefill, an eviction) or while the server
served background traffic, beside the miss; how much of P each hit read; and the load the
server reported while the traffic arm ran."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvreplay.core.claims import key
from kvreplay.experiments.history.table import HISTORIES, HISTORY_TABLE, LOAD
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Rate
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "history"
ARMS = ("miss", *HISTORIES)
"""The arms each compared with the hit alone (and, but the miss, with the miss)."""


@dataclass(frozen=True)
class Reads:
    """How much of what its history wrote a hit's first request read, over rows."""

    all: int
    part: int
    none: int

    @classmethod
    def of(cls, values: np.ndarray) -> Reads:
        return cls(*(sum(1 for v in values if v == what) for what in ("all", "part", "none")))

    @property
    def text(self) -> str:
        return f"{self.all}/{self.part}/{self.none}"


@dataclass(frozen=True)
class HistoryArm:
    """One arm against the hit alone and (a history) against the miss, and its reads."""

    name: str
    differs_from_hit: Rate
    differs_from_miss: Rate | None = None
    read: Reads | None = None


@dataclass(frozen=True)
class HistoryPrecision:
    """One precision: each arm's rate of suffixes differing from the hit and from the
    miss, how much each hit read, and the traffic's load (medians over the rows)."""

    backend: str
    rows: int
    miss_differs_from_hit: Rate
    traffic_differs_from_hit: Rate
    traffic_differs_from_miss: Rate
    traffic_read: Reads
    warm_differs_from_hit: Rate
    warm_differs_from_miss: Rate
    warm_read: Reads
    evicted_differs_from_hit: Rate
    evicted_differs_from_miss: Rate
    evicted_read: Reads
    hit_read: Reads
    traffic_load_median: dict[str, float | None]

    @property
    def arms(self) -> tuple[HistoryArm, ...]:
        """The arms in :data:`ARMS` order."""
        return (
            HistoryArm("miss", self.miss_differs_from_hit),
            HistoryArm(
                "traffic", self.traffic_differs_from_hit, self.traffic_differs_from_miss,
                self.traffic_read,
            ),
            HistoryArm(
                "warm", self.warm_differs_from_hit, self.warm_differs_from_miss, self.warm_read
            ),
            HistoryArm(
                "evicted", self.evicted_differs_from_hit, self.evicted_differs_from_miss,
                self.evicted_read,
            ),
        )  # fmt: skip


@dataclass(frozen=True)
class HistoryClaims:
    precisions: dict[str, HistoryPrecision] = field(metadata=key(SECTION))


def _rate(values: np.ndarray) -> Rate:
    known = [v for v in values if v is not None]
    return Rate.of(sum(1 for v in known if not v), len(known), MATRIX_WILSON_Z)


def _median(values: np.ndarray) -> float | None:
    known = [float(v) for v in values if v is not None and not math.isnan(v)]
    return float(np.median(known)) if known else None


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _claims(reading: Reading) -> HistoryClaims:
    (ledger,) = reading.ledgers.values()
    found = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        arms = {f"{arm}_differs_from_hit": _rate(rows[f"{arm}_equal_hit"]) for arm in ARMS}
        for arm in HISTORIES:
            arms[f"{arm}_differs_from_miss"] = _rate(rows[f"{arm}_equal_miss"])
            arms[f"{arm}_read"] = Reads.of(rows[f"{arm}_read"])
        found[precision] = HistoryPrecision(
            backend=str(rows["backend"][0]),
            rows=len(rows),
            **arms,
            hit_read=Reads.of(rows["hit_read"]),
            traffic_load_median={name: _median(rows[f"traffic_{name}"]) for name, _ in LOAD},
        )
    return HistoryClaims(found)


def _summary(claims: HistoryClaims) -> list[str]:
    return [
        f"{SECTION} {precision}: suffix differs from the hit alone: "
        + ", ".join(f"{arm.name} {arm.differs_from_hit.text}" for arm in p.arms)
        + f"; evicted hit read all/part/none {p.evicted_read.text}"
        for precision, p in claims.precisions.items()
    ]


HISTORY_NOTE = (
    "The same hit request for P's first suffix stage, from a reset cache each time, after "
    "different histories of P's cached blocks: written by the generation that decoded "
    "through P (the hit), by one earlier one-shot prefill of P (warm), or by that "
    "generation followed by unrelated prompts that overwrote part of them (evicted); and "
    "the hit while background clients sent other prompts (traffic). A hit that read none "
    "of what its history wrote is counted under 'none', never as a hit. The load is what "
    "the server reported while the traffic arm ran (medians over rows)."
)


def _report(page: Page[HistoryClaims]) -> list[Block]:
    precisions = page.claims.precisions
    if not precisions:
        return []
    rows = [
        (
            precision,
            arm.name,
            arm.differs_from_hit.text,
            arm.differs_from_miss.text if arm.differs_from_miss else "—",
            arm.read.text if arm.read else "—",
        )
        for precision, p in precisions.items()
        for arm in p.arms
    ]
    loads = [
        (precision, *(_number(p.traffic_load_median[name]) for name, _ in LOAD))
        for precision, p in precisions.items()
    ]
    return [
        Heading("History: the same hit after different histories, and under traffic"),
        Paragraph(HISTORY_NOTE),
        Grid(
            ("precision", "arm", "differs from hit", "differs from miss", "read all/part/none"),
            rows,
        ),
        Grid(("precision", *(f"traffic {name}" for name, _ in LOAD)), loads),
    ]


HISTORY = Section("history", (HISTORY_TABLE,), HistoryClaims, _claims, _summary, report=_report)
