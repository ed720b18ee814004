"""The bridge section: the live cache against its teacher-forced rebuild on newly reached
prefixes (``prospective_bridge``), beside the paper's 12/12."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.core.claims import key
from kvreplay.experiments.bridge.table import BRIDGE_TABLE
from kvreplay.harness.section import Reading, Row, Section
from kvreplay.measure.rates import count, fraction

SECTION = "prospective_bridge"
PAPER_BRIDGE_EXACT = (12, 12)


@dataclass(frozen=True)
class Bridge:
    """Exactness counts (rows whose column holds) and the range of prefix lengths, new
    and historical."""

    rows: int
    integrity_pass_rows: int
    live_matches_historical_prefix_rows: int
    live_teacher_cache_exact_rows: int
    live_teacher_logits_exact_rows: int
    live_teacher_suffix_exact_rows: int
    all_48_layers_exact_rows: int
    new_prefix_length_range: tuple[int, int]
    historical_prefix_length_range: tuple[int, int]


@dataclass(frozen=True)
class BridgeClaims:
    bridge: Bridge = field(metadata=key(SECTION))


COUNTED = (
    "integrity_pass",
    "live_matches_historical_prefix",
    "live_teacher_cache_exact",
    "live_teacher_logits_exact",
    "live_teacher_suffix_exact",
    "all_48_layers_exact",
)
"""The columns whose rows the claims count (``<column>_rows``)."""


def _claims(reading: Reading) -> BridgeClaims:
    (ledger,) = reading.ledgers.values()

    def span(kind: str) -> tuple[int, int]:
        lengths = ledger[f"{kind}_prefix_token_count"]
        return int(lengths.min()), int(lengths.max())

    counts = {f"{column}_rows": count(ledger[column]) for column in COUNTED}
    return BridgeClaims(
        Bridge(len(ledger), **counts, new_prefix_length_range=span("new"),
               historical_prefix_length_range=span("historical"))
    )  # fmt: skip


def _summary(claims: BridgeClaims) -> list[str]:
    bridge = claims.bridge
    return [
        f"{SECTION}: {bridge.live_teacher_suffix_exact_rows}/{bridge.rows}"
        f" suffixes exact, {bridge.all_48_layers_exact_rows}/{bridge.rows} caches"
        " exact in all layers"
    ]


def _headline(claims: BridgeClaims) -> list[Row]:
    return [
        (
            "prospective bridge: live vs teacher-forced, suffix exact",
            fraction(claims.bridge.live_teacher_suffix_exact_rows, claims.bridge.rows),
            fraction(*PAPER_BRIDGE_EXACT),
        )
    ]


BRIDGE = Section(
    "bridge", (BRIDGE_TABLE,), BridgeClaims, _claims, _summary, _headline, paper_order=2
)
