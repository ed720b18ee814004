"""Every CSV kvreplay writes or reads, each declared once (design: table), and which one a
file or a run's experiment is. No torch: ``kvreplay analyze`` reads a CSV as its table,
and the audit and analysis derive a run's CSVs from its rows through the same tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.backends import backend_from_contract
from kvreplay.core.errors import KvreplayError
from kvreplay.experiments.paper.table import HISTORICAL_TABLE, STOCK_TABLE
from kvreplay.harness.table import Table, read_header


def experiment_tables() -> dict[str, tuple[Table, Table | None]]:
    """Each experiment's table, and its table as served panels (None: the experiment
    reads or writes K/V, so a backend without K/V access does not run it), from the
    experiments' declarations."""
    from kvreplay.experiments.registry import declared

    return {name: (d.table, d.served_table) for name, d in declared().items()}


def tables() -> tuple[Table, ...]:
    """Every table: the experiments', then the paper release's."""
    pairs = experiment_tables().values()
    return (
        *dict.fromkeys(table for pair in pairs for table in pair if table is not None),
        HISTORICAL_TABLE,
        STOCK_TABLE,
    )


def __getattr__(name: str) -> Any:
    """``EXPERIMENT_TABLES`` and ``TABLES``, read from the declarations when first used
    (a declaration's module imports its table from this package)."""
    if name == "EXPERIMENT_TABLES":
        return experiment_tables()
    if name == "TABLES":
        return tables()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def table_for(path: Path) -> Table | None:
    """The table a CSV file is read as, or None for any other file; of two tables of one
    file, the one whose marker column the CSV has (a served run's ``backend``)."""
    found = [table for table in tables() if table.matches(path.name)]
    if any(table.marker for table in found):
        header = read_header(path)
        found = [table for table in found if table.marker in (None, *header)]
    return max(found, key=lambda table: table.marker is not None, default=None)


def recorded_table(name: str, manifest: dict[str, Any]) -> Table | None:
    """The table a run's experiment wrote, as its backend ran it; None if this kvreplay
    cannot derive it (an unknown experiment or backend)."""
    run = manifest.get("contract", {}).get("run")
    try:
        backend = backend_from_contract(run.get("backend") if isinstance(run, dict) else None)
        table, served = experiment_tables()[name]
    except (KvreplayError, KeyError, TypeError):
        return None
    return served if backend.runs_served(served is not None) else table
