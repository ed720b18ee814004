"""The bridge section: the live cache against its teacher-forced rebuild on newly reached
prefixes (``prospective_bridge``), beside the paper's 12/12."""

from __future__ import annotations

from kvreplay.experiments.bridge.table import BRIDGE_TABLE
from kvreplay.harness.section import Reading, Row, Section
from kvreplay.measure.rates import Json, count, fraction

SECTION = "prospective_bridge"
PAPER_BRIDGE_EXACT = (12, 12)


def _claims(reading: Reading) -> Json:
    """Exactness counts and the range of prefix lengths, new and historical."""
    (ledger,) = reading.ledgers.values()
    return {
        SECTION: {
            "rows": len(ledger),
            **{
                f"{column}_rows": count(ledger[column])
                for column in (
                    "integrity_pass",
                    "live_matches_historical_prefix",
                    "live_teacher_cache_exact",
                    "live_teacher_logits_exact",
                    "live_teacher_suffix_exact",
                    "all_48_layers_exact",
                )
            },
            **{
                f"{kind}_prefix_length_range": [
                    int(ledger[f"{kind}_prefix_token_count"].min()),
                    int(ledger[f"{kind}_prefix_token_count"].max()),
                ]
                for kind in ("new", "historical")
            },
        }
    }


def _summary(claims: Json) -> list[str]:
    if (bridge := claims.get(SECTION)) is None:
        return []
    return [
        f"{SECTION}: {bridge['live_teacher_suffix_exact_rows']}/{bridge['rows']}"
        f" suffixes exact, {bridge['all_48_layers_exact_rows']}/{bridge['rows']} caches"
        " exact in all layers"
    ]


def _headline(claims: Json) -> list[Row]:
    if (bridge := claims.get(SECTION)) is None:
        return []
    return [
        (
            "prospective bridge: live vs teacher-forced, suffix exact",
            fraction(bridge["live_teacher_suffix_exact_rows"], bridge["rows"]),
            fraction(*PAPER_BRIDGE_EXACT),
        )
    ]


BRIDGE = Section("bridge", (BRIDGE_TABLE,), _claims, _summary, _headline, paper_order=2)
