"""Sections of CSVs only the paper's release has: the historical bridge audit (every
equality flag of the historical join) and the batch-composition control on a stock
checkpoint (exactness counts only)."""

from __future__ import annotations

from kvreplay.experiments.paper.table import (
    HISTORICAL_FLAG_COLUMNS,
    HISTORICAL_LEAF_COLUMNS,
    HISTORICAL_TABLE,
    STOCK_TABLE,
)
from kvreplay.harness.section import Reading, Section
from kvreplay.measure.rates import Json, count

HISTORICAL_SECTION = "historical_bridge"
STOCK_SECTION = "stock_qwen_diagnostic"


def _historical(reading: Reading) -> Json:
    """Counts of every equality flag of the historical join, plus its schema leaf counts."""
    (ledger,) = reading.ledgers.values()
    return {
        HISTORICAL_SECTION: {
            "rows": len(ledger),
            **{f"{column}_rows": count(ledger[column]) for column in HISTORICAL_FLAG_COLUMNS},
            **{column: int(ledger[column][0]) for column in HISTORICAL_LEAF_COLUMNS},
        }
    }


def _historical_summary(claims: Json) -> list[str]:
    if (historical := claims.get(HISTORICAL_SECTION)) is None:
        return []
    audits = f"{historical['audit_pass_rows']}/{historical['rows']}"
    return [f"{HISTORICAL_SECTION}: {audits} audits pass"]


STOCK_COUNTS = {
    "pair_replica_token_exact_rows": "pair_replica_tokens_exact",
    "pair_replica_logprob_exact_rows": "pair_replica_logprobs_exact",
    "singleton_pair_token_exact_rows": "singleton_pair_tokens_exact",
    "singleton_pair_logprob_exact_rows": "singleton_pair_logprobs_exact",
}
"""Each count of the stock control's claims, and the column it counts."""


def _stock(reading: Reading) -> Json:
    """Batch-composition control on a public checkpoint: exactness counts only."""
    (ledger,) = reading.ledgers.values()
    return {
        STOCK_SECTION: {
            "rows": len(ledger),
            **{key: count(ledger[column]) for key, column in STOCK_COUNTS.items()},
        }
    }


def _stock_summary(claims: Json) -> list[str]:
    if (stock := claims.get(STOCK_SECTION)) is None:
        return []
    exact = f"{stock['singleton_pair_token_exact_rows']}/{stock['rows']}"
    return [f"{STOCK_SECTION}: singleton vs pair tokens exact {exact}"]


HISTORICAL = Section(
    "historical", (HISTORICAL_TABLE,), _historical, _historical_summary, paper_order=3
)
STOCK = Section("stock", (STOCK_TABLE,), _stock, _stock_summary, paper_order=6)
