"""The served section: what a served ``matched`` ledger (a backend without K/V access)
adds beside the matrix: how much of P the prefix-cache hit really reused, and how often
each control continued differently."""

from __future__ import annotations

from kvreplay.experiments.matrix.table import SERVED_CONTROLS, SERVED_MATCHED_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Json, median, rate_payload, rate_text
from kvreplay.measure.stats import MATRIX_WILSON_Z
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "served_matched"


def _differs(control: str) -> str:
    """The claims key of a control: ``uninterrupted_differs_from_live`` and so on."""
    return control.replace("_equal_", "_differs_from_")


def _claims(reading: Reading) -> Json:
    """Per precision: the engine, the cached tokens the hit and the miss read beside P's
    length, and each control's rate of differing suffixes where it ran."""
    (ledger,) = reading.ledgers.values()
    section: Json = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        block: Json = {
            "backend": str(rows["backend"][0]),
            "rows": len(rows),
            "live_cached_tokens_median": median(rows["live_cached_tokens"]),
            "prefill_cached_tokens_median": median(rows["prefill_cached_tokens"]),
            "prefix_token_count_median": median(rows["prefix_token_count"]),
        }
        for column, label in SERVED_CONTROLS.items():
            known = [v for v in rows[column] if v is not None]
            differ = sum(1 for v in known if not v)
            block[_differs(column)] = {
                "label": label,
                **rate_payload(differ, len(known), MATRIX_WILSON_Z),
            }
        section[precision] = block
    return {SECTION: section}


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


def _report(page: Page) -> list[Block]:
    """What a served run adds: its controls and how much of P the hit reused."""
    section = page.claims.get(SECTION)
    if not section:
        return []
    rows = [
        (
            precision,
            f"{b['live_cached_tokens_median']:g} / {b['prefix_token_count_median']:g}",
            f"{b['prefill_cached_tokens_median']:g}",
            *(rate_text(b[key]) if b[key]["n"] else "—" for key in map(_differs, SERVED_CONTROLS)),
        )
        for precision, b in section.items()
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


SERVED = Section("served", (SERVED_MATCHED_TABLE,), _claims, report=_report, paper_order=5)
