"""The history section: whether the same prefix-cache hit continues differently when P's
blocks were written by another history (a warm prefill, an eviction) or while the server
served background traffic, beside the miss; how much of P each hit read; and the load the
server reported while the traffic arm ran."""

from __future__ import annotations

import math

import numpy as np

from kvreplay.experiments.history.table import HISTORIES, HISTORY_TABLE, LOAD
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Json, rate_payload, rate_text
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "history"
ARMS = ("miss", *HISTORIES)
"""The arms each compared with the hit alone (and, but the miss, with the miss)."""


def _rate(values: np.ndarray) -> Json:
    known = [v for v in values if v is not None]
    return rate_payload(sum(1 for v in known if not v), len(known), MATRIX_WILSON_Z)


READS = ("all", "part", "none")


def _reads(values: np.ndarray) -> dict[str, int]:
    return {what: sum(1 for v in values if v == what) for what in READS}


def _read_text(reads: Json) -> str:
    """all/part/none counts (claims.json sorts its keys, so they are named here)."""
    return "/".join(str(reads[what]) for what in READS)


def _median(values: np.ndarray) -> float | None:
    known = [float(v) for v in values if v is not None and not math.isnan(v)]
    return float(np.median(known)) if known else None


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _claims(reading: Reading) -> Json:
    """Per precision: each arm's rate of suffixes differing from the hit and from the
    miss, how much of what its history wrote each hit read, and the traffic's load
    (medians over the rows)."""
    (ledger,) = reading.ledgers.values()
    section: Json = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        block: Json = {"backend": str(rows["backend"][0]), "rows": len(rows)}
        for arm in ARMS:
            block[f"{arm}_differs_from_hit"] = _rate(rows[f"{arm}_equal_hit"])
            if arm != "miss":
                block[f"{arm}_differs_from_miss"] = _rate(rows[f"{arm}_equal_miss"])
                block[f"{arm}_read"] = _reads(rows[f"{arm}_read"])
        block["hit_read"] = _reads(rows["hit_read"])
        block["traffic_load_median"] = {name: _median(rows[f"traffic_{name}"]) for name, _ in LOAD}
        section[precision] = block
    return {SECTION: section}


def _summary(claims: Json) -> list[str]:
    return [
        f"{SECTION} {precision}: suffix differs from the hit alone: "
        + ", ".join(f"{arm} {rate_text(b[f'{arm}_differs_from_hit'])}" for arm in ARMS)
        + f"; evicted hit read all/part/none {_read_text(b['evicted_read'])}"
        for precision, b in claims.get(SECTION, {}).items()
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


def _report(page: Page) -> list[Block]:
    section = page.claims.get(SECTION)
    if not section:
        return []
    rows = [
        (
            precision,
            arm,
            rate_text(b[f"{arm}_differs_from_hit"]),
            rate_text(b[f"{arm}_differs_from_miss"]) if arm != "miss" else "—",
            _read_text(b[f"{arm}_read"]) if arm != "miss" else "—",
        )
        for precision, b in section.items()
        for arm in ARMS
    ]
    loads = [
        (precision, *(_number(b["traffic_load_median"][name]) for name, _ in LOAD))
        for precision, b in section.items()
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


HISTORY = Section("history", (HISTORY_TABLE,), _claims, _summary, report=_report)
