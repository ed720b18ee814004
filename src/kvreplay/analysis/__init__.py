"""Ledger analysis: validate the paper-named CSVs and compute the paper's claims."""

from kvreplay.analysis.claims import SCHEMA, analyze_dir, build_claims, write_claims
from kvreplay.analysis.ledgers import LedgerError, load_ledger_dir

__all__ = [
    "SCHEMA",
    "LedgerError",
    "analyze_dir",
    "build_claims",
    "load_ledger_dir",
    "write_claims",
]
