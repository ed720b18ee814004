"""Sections of CSVs only the paper's release has: the historical bridge audit (every
equality flag of the historical join) and the batch-composition control on a stock
checkpoint (exactness counts only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.core.claims import key
from kvreplay.experiments.paper.table import (
    HISTORICAL_FLAG_COLUMNS,
    HISTORICAL_LEAF_COLUMNS,
    HISTORICAL_TABLE,
    STOCK_TABLE,
)
from kvreplay.harness.section import Reading, Section
from kvreplay.measure.rates import count

HISTORICAL_SECTION = "historical_bridge"
STOCK_SECTION = "stock_qwen_diagnostic"


@dataclass(frozen=True)
class Historical:
    """The historical join: rows where each equality flag holds, and the schema's leaf
    counts (the same on every row)."""

    rows: int
    prefix_commitment_equal_rows: int
    live_incremental_suffix_equal_rows: int
    live_replica_suffix_equal_rows: int
    prefill_suffix_equal_rows: int
    prefill_replica_suffix_equal_rows: int
    comparison_objects_equal_rows: int
    cache_live_replica_fingerprint_equal_rows: int
    cache_live_prefill_fingerprint_equal_rows: int
    cache_prefill_replica_fingerprint_equal_rows: int
    logits_live_replica_fingerprint_equal_rows: int
    logits_live_prefill_fingerprint_equal_rows: int
    logits_prefill_replica_fingerprint_equal_rows: int
    audit_pass_rows: int
    cache_common_scalar_leaves_per_section: int
    logit_common_scalar_leaves_per_section: int


@dataclass(frozen=True)
class HistoricalClaims:
    historical: Historical = field(metadata=key(HISTORICAL_SECTION))


def _historical(reading: Reading) -> HistoricalClaims:
    """Counts of every equality flag of the historical join, plus its schema leaf counts."""
    (ledger,) = reading.ledgers.values()
    flags = {f"{column}_rows": count(ledger[column]) for column in HISTORICAL_FLAG_COLUMNS}
    leaves = {column: int(ledger[column][0]) for column in HISTORICAL_LEAF_COLUMNS}
    return HistoricalClaims(Historical(len(ledger), **flags, **leaves))


def _historical_summary(claims: HistoricalClaims) -> list[str]:
    historical = claims.historical
    return [f"{HISTORICAL_SECTION}: {historical.audit_pass_rows}/{historical.rows} audits pass"]


@dataclass(frozen=True)
class Stock:
    """The batch-composition control on a public checkpoint: exactness counts only."""

    rows: int
    pair_replica_token_exact_rows: int
    pair_replica_logprob_exact_rows: int
    singleton_pair_token_exact_rows: int
    singleton_pair_logprob_exact_rows: int


@dataclass(frozen=True)
class StockClaims:
    stock: Stock = field(metadata=key(STOCK_SECTION))


STOCK_COUNTS = {
    "pair_replica_token_exact_rows": "pair_replica_tokens_exact",
    "pair_replica_logprob_exact_rows": "pair_replica_logprobs_exact",
    "singleton_pair_token_exact_rows": "singleton_pair_tokens_exact",
    "singleton_pair_logprob_exact_rows": "singleton_pair_logprobs_exact",
}
"""Each count of the stock control's claims, and the column it counts."""


def _stock(reading: Reading) -> StockClaims:
    (ledger,) = reading.ledgers.values()
    counts = {name: count(ledger[column]) for name, column in STOCK_COUNTS.items()}
    return StockClaims(Stock(len(ledger), **counts))


def _stock_summary(claims: StockClaims) -> list[str]:
    stock = claims.stock
    exact = f"{stock.singleton_pair_token_exact_rows}/{stock.rows}"
    return [f"{STOCK_SECTION}: singleton vs pair tokens exact {exact}"]


HISTORICAL = Section(
    "historical",
    (HISTORICAL_TABLE,),
    HistoricalClaims,
    _historical,
    _historical_summary,
    paper_order=3,
)
STOCK = Section("stock", (STOCK_TABLE,), StockClaims, _stock, _stock_summary, paper_order=6)
