"""A forger's tools, for the audit tests: read and rewrite a run folder's manifest and rows
as an adversary would, with kvreplay's own encoders (rows rechained, hashes recomputed,
the CSV re-derived), and read what the audit then says."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import Result
from helpers import invoke

from kvreplay.core.canonical import sha256_json
from kvreplay.experiments.registry import recorded_table
from kvreplay.ledger import GENESIS, Record

CSV = "matched_live_prefill.csv"


def audit(run: Path, *extra: object) -> Result:
    return invoke("audit", run, *extra)


def problems(result: Result) -> list[str]:
    return [line.strip()[2:] for line in result.stdout.splitlines() if line.startswith("  - ")]


def assert_named(result: Result, *needles: str) -> None:
    """Exit 1 and one problem line that names every needle (a row and a field)."""
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stdout
    found = [p for p in problems(result) if all(n in p for n in needles)]
    assert found, (needles, problems(result))


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def write_manifest(folder: Path, data: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(data, indent=2))


def rechain(
    folder: Path,
    rows: list[dict],
    contract_hash: str | None = None,
    derive_csv: bool = True,
    experiment: str = "matched",
) -> None:
    """Rewrite rows.jsonl as a valid chain and re-derive the experiment's CSV, as a forger
    would."""
    contract_hash = contract_hash or sha256_json(manifest(folder)["contract"])
    records, prev = [], GENESIS
    for seq, row in enumerate(rows):
        record = Record(**{**row, "seq": seq, "prev": prev, "contract": contract_hash})
        record.hash = record.expected_hash()
        records.append(record)
        prev = record.hash
    (folder / "rows.jsonl").write_text("".join(r.to_line() for r in records))
    if not derive_csv:
        return
    recorded = manifest(folder)
    table = recorded_table(experiment, recorded)  # a served run's is the served table
    assert table is not None
    config = recorded["experiments"][experiment]["config"]
    (folder / table.csv_name(config)).write_text(table.csv(records, config))
