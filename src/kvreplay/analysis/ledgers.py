"""Read a folder of paper-named CSV ledgers, each as its table, failing closed.

A claim is only as good as the rows under it, so every gate of the paper's method is
checked before anything is counted (each table declares its columns and gates: see
:mod:`kvreplay.harness.table`). In a kvreplay run folder the CSVs must also still be
what the run's rows.jsonl derives; its rows are read once, here, for every section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvreplay.experiments.registry import table_for
from kvreplay.harness.table import Ledger, LedgerError, read_ledger
from kvreplay.ledger import RunRows


@dataclass(frozen=True)
class LedgerDir:
    """A folder as analysis reads it: each known CSV as its table, by file name in sorted
    order, and in a kvreplay run the rows of its rows.jsonl, from which those CSVs were
    checked to derive, read afresh by each reader so that no reader holds them all
    (None: a folder of CSVs alone, such as the paper's release)."""

    ledgers: dict[str, Ledger]
    records: RunRows | None


def load_ledger_dir(folder: Path) -> LedgerDir:
    """Every known ledger in a folder, validated, and a run's rows."""
    if not folder.is_dir():
        raise LedgerError(str(folder), "the folder does not exist or is not a directory")
    ledgers = {
        path.name: read_ledger(path, table)
        for path in sorted(folder.iterdir())
        if path.is_file() and (table := table_for(path)) is not None
    }
    if not ledgers:
        raise LedgerError(str(folder), "the folder holds none of the known ledger CSVs")
    rows = folder / "rows.jsonl"
    if (folder / "manifest.json").is_file() and (rows.exists() or rows.is_symlink()):
        return LedgerDir(ledgers, _run_records(folder))  # rows.jsonl not a file is named
    return LedgerDir(ledgers, None)


def _run_records(folder: Path) -> RunRows:
    """A kvreplay run's CSVs are derived from its rows.jsonl, the source of truth: one
    cut at a row boundary (or edited) would otherwise be analysed as a smaller (or
    different) run."""
    from kvreplay.analysis.derived import check_csvs
    from kvreplay.ledger import RunLedger

    ledger = RunLedger.open_existing(folder)
    # The sections and the CSV check pass over the rows in file order: no index held.
    records, problems = RunRows.checked(ledger.rows_path, ledger.contract_hash, indexed=False)
    if not problems:
        problems += check_csvs(ledger, records, present_only=True)
    if problems:
        raise LedgerError(
            str(folder),
            f"the run's CSVs do not match its rows.jsonl ({problems[0]}); "
            "rerun the experiment to rewrite them, or run kvreplay audit",
        )
    return records
