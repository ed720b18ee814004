"""The served section: what a served ``matched`` ledger (a backend without K/V access)
adds beside the matrix: how much of P the prefix-cache hit really reused, and how often
each control continued differently."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvreplay.core.claims import key
from kvreplay.experiments.matrix.table import SERVED_CONTROLS, SERVED_MATCHED_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Rate, median
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "served_matched"


@dataclass(frozen=True)
class ControlRate(Rate):
    """A control's rate of differing suffixes, where it ran, and what it compares."""

    label: str = ""


@dataclass(frozen=True)
class ServedPrecision:
    """One precision: the engine, the cached tokens the hit and the miss read beside P's
    length, and each control's rate of differing suffixes."""

    backend: str
    rows: int
    live_cached_tokens_median: float
    prefill_cached_tokens_median: float
    prefix_token_count_median: float
    uninterrupted_differs_from_live: ControlRate
    uninterrupted_differs_from_prefill: ControlRate
    batched_differs_from_live: ControlRate


@dataclass(frozen=True)
class ServedClaims:
    precisions: dict[str, ServedPrecision] = field(metadata=key(SECTION))


CONTROLS: dict[str, Callable[[ServedPrecision], ControlRate]] = {
    "uninterrupted_equal_live": lambda p: p.uninterrupted_differs_from_live,
    "uninterrupted_equal_prefill": lambda p: p.uninterrupted_differs_from_prefill,
    "batched_equal_live": lambda p: p.batched_differs_from_live,
}
"""Each control column of the served table, and its claim."""
assert CONTROLS.keys() == SERVED_CONTROLS.keys()


def _differs(column: str) -> str:
    """The claim of a control column: ``uninterrupted_differs_from_live`` and so on."""
    return column.replace("_equal_", "_differs_from_")


def _claims(reading: Reading) -> ServedClaims:
    (ledger,) = reading.ledgers.values()
    found = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        controls = {}
        for column, label in SERVED_CONTROLS.items():
            known = [v for v in rows[column] if v is not None]
            differ = sum(1 for v in known if not v)
            rate = Rate.of(differ, len(known), MATRIX_WILSON_Z)
            controls[_differs(column)] = ControlRate(**vars(rate), label=label)
        found[precision] = ServedPrecision(
            backend=str(rows["backend"][0]),
            rows=len(rows),
            live_cached_tokens_median=median(rows["live_cached_tokens"]),
            prefill_cached_tokens_median=median(rows["prefill_cached_tokens"]),
            prefix_token_count_median=median(rows["prefix_token_count"]),
            **controls,
        )
    return ServedClaims(found)


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


def _report(page: Page[ServedClaims]) -> list[Block]:
    """What a served run adds: its controls and how much of P the hit reused."""
    precisions = page.claims.precisions
    if not precisions:
        return []
    rows = [
        (
            precision,
            f"{p.live_cached_tokens_median:g} / {p.prefix_token_count_median:g}",
            f"{p.prefill_cached_tokens_median:g}",
            *(rate.text if (rate := claim(p)).n else "—" for claim in CONTROLS.values()),
        )
        for precision, p in precisions.items()
    ]
    return [
        Heading("Serving engine: prefix-cache hit vs miss"),
        Paragraph(SERVED_NOTE),
        Grid(
            (
                "precision",
                "hit cached tokens / P (median)",
                "miss cached tokens (median)",
                *(f"{label}: suffixes differ" for label in SERVED_CONTROLS.values()),
            ),
            rows,
        ),
    ]


SERVED = Section(
    "served", (SERVED_MATCHED_TABLE,), ServedClaims, _claims, report=_report, paper_order=5
)
