"""Every CSV kvreplay writes or reads, each declared once (design: table), and which one a
file or a run's experiment is. No torch: ``kvreplay analyze`` reads a CSV as its table,
and the audit and analysis derive a run's CSVs from its rows through the same tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.backends import backend_from_contract
from kvreplay.errors import KvreplayError
from kvreplay.experiments.table import Table, read_header
from kvreplay.experiments.tables.bridge import BRIDGE, BRIDGE_TABLE
from kvreplay.experiments.tables.history import HISTORY, HISTORY_TABLE
from kvreplay.experiments.tables.localize import LOCALIZE, LOCALIZE_TABLE
from kvreplay.experiments.tables.matrix import (
    FIXED_PREFIX,
    FIXED_PREFIX_TABLE,
    MATCHED,
    MATCHED_TABLE,
    SERVED_MATCHED_TABLE,
)
from kvreplay.experiments.tables.paper import HISTORICAL_TABLE, STOCK_TABLE
from kvreplay.experiments.tables.resample import RESAMPLE, RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE
from kvreplay.experiments.tables.transplant import TRANSPLANT, TRANSPLANT_TABLE

EXPERIMENT_TABLES: dict[str, tuple[Table, Table | None]] = {
    MATCHED: (MATCHED_TABLE, SERVED_MATCHED_TABLE),
    FIXED_PREFIX: (FIXED_PREFIX_TABLE, None),
    BRIDGE: (BRIDGE_TABLE, None),
    TRANSPLANT: (TRANSPLANT_TABLE, None),
    RESAMPLE: (RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE),
    LOCALIZE: (LOCALIZE_TABLE, None),
    HISTORY: (HISTORY_TABLE, HISTORY_TABLE),  # served only: history refuses other backends
}
"""Each experiment's table, and its table as served panels (None: the experiment reads or
writes K/V, so a backend without K/V access does not run it)."""
TABLES = (
    *dict.fromkeys(
        table for pair in EXPERIMENT_TABLES.values() for table in pair if table is not None
    ),
    HISTORICAL_TABLE,
    STOCK_TABLE,
)


def table_for(path: Path) -> Table | None:
    """The table a CSV file is read as, or None for any other file; of two tables of one
    file, the one whose marker column the CSV has (a served run's ``backend``)."""
    tables = [table for table in TABLES if table.matches(path.name)]
    if any(table.marker for table in tables):
        header = read_header(path)
        tables = [table for table in tables if table.marker in (None, *header)]
    return max(tables, key=lambda table: table.marker is not None, default=None)


def recorded_table(name: str, manifest: dict[str, Any]) -> Table | None:
    """The table a run's experiment wrote, as its backend ran it; None if this kvreplay
    cannot derive it (an unknown experiment or backend)."""
    run = manifest.get("contract", {}).get("run")
    try:
        backend = backend_from_contract(run.get("backend") if isinstance(run, dict) else None)
        table, served = EXPERIMENT_TABLES[name]
    except (KvreplayError, KeyError, TypeError):
        return None
    return served if backend.runs_served(served is not None) else table
