"""Issue 34, item 10: audit and analysis at scale. A synthetic run of many rows (written by
bench/synthetic_ledger.py from a committed run's rows, re-chained) audits with
``--sample 0`` reading the backend registry once, not once per row; and ``analyze``
reads rows.jsonl as a stream, holding a row at a time, with the claims it would compute
from every row held in memory. Correctness, not timing: the figures are in
docs/benchmarks/analysis-audit.md."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from helpers import invoke

from kvreplay.analysis.claims import build_claims
from kvreplay.analysis.ledgers import LedgerDir, load_ledger_dir
from kvreplay.audit.audit import RowChecks
from kvreplay.core import registry
from kvreplay.ledger import Record, RowAt, RunRows, TamperedLedger

REPO = Path(__file__).resolve().parents[2]
ROWS = 240  # 120 items at two precisions: 5x the committed run it is made from


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "run"
    script = REPO / "bench" / "synthetic_ledger.py"
    subprocess.run([sys.executable, str(script), str(out), "--rows", str(ROWS)], check=True)
    return out


def test_structural_audit_reads_the_registry_once(
    big_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row names a precision, which the backend registry answers; finding the
    backends packages register reads every installed distribution's metadata, so it
    must happen once per audit, not once per row."""
    calls: list[str] = []
    real = registry.entry_points

    def counted(**kwargs: str) -> object:
        calls.append(kwargs["group"])
        return real(**kwargs)

    monkeypatch.setattr(registry, "entry_points", counted)
    registry.installed_entries.cache_clear()
    result = invoke("audit", big_run, "--sample", "0")
    assert result.exit_code == 0, result.output
    assert f"rows in ledger: {ROWS}; re-executed: 0" in result.stdout
    assert "PASS" in result.stdout
    assert calls.count("kvreplay.backends") <= 1


def _live_records() -> int:
    return sum(type(o) is Record for o in gc.get_objects())


def test_analyze_holds_one_row_at_a_time(
    big_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While analyze reads the rows (the CSV check, the flip predictor's margins), no
    more than a few rows are alive at once; its claims are those of every row in memory."""
    seen: list[int] = []
    real = RunRows.__iter__

    def watched(self: RunRows) -> Iterator[Record]:
        for index, record in enumerate(real(self)):
            if index % 100 == 99:
                seen.append(_live_records())
            yield record

    monkeypatch.setattr(RunRows, "__iter__", watched)
    result = invoke("analyze", big_run, "-o", tmp_path / "claims.json")
    assert result.exit_code == 0, result.output
    assert seen and max(seen) <= 4, seen  # the row, the one before it, a test's own
    monkeypatch.undo()
    folder = load_ledger_dir(big_run)
    assert isinstance(folder.records, RunRows)
    held = build_claims(LedgerDir(folder.ledgers, list(folder.records))).to_json()
    streamed = json.loads((tmp_path / "claims.json").read_text())
    assert streamed == json.loads(json.dumps(held))
    assert held["extra"]["flip_predictor"]  # the predictor read every row's margins


def test_structural_audit_holds_one_row_at_a_time(
    big_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit checks each row as the chain check reads it and keeps only what a later
    check needs; the CSV check and the plan read rows afresh. At no point are more than
    a few rows alive, so its memory does not grow with the ledger."""
    seen: list[int] = []
    visit, read = RowChecks.visit, RunRows.read

    def watched_visit(self: RowChecks, record: Record) -> None:
        visit(self, record)
        if record.seq % 50 == 49:
            seen.append(_live_records())

    def watched_read(self: RunRows, rows: Iterable[RowAt]) -> Iterator[Record]:
        for index, record in enumerate(read(self, rows)):
            if index % 50 == 49:
                seen.append(_live_records())
            yield record

    monkeypatch.setattr(RowChecks, "visit", watched_visit)
    monkeypatch.setattr(RunRows, "read", watched_read)
    result = invoke("audit", big_run, "--sample", "0")
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    assert len(seen) == 2 * (ROWS // 50), seen  # the chain pass, then the CSV's lines
    assert max(seen) <= 4, seen


def test_rows_changed_after_the_check_are_refused(big_run: Path, tmp_path: Path) -> None:
    """A stream re-reads rows.jsonl; a file changed since its chain was checked is
    refused rather than analysed as the checked one."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes((big_run / "rows.jsonl").read_bytes())
    contract = json.loads((big_run / "manifest.json").read_text())["contract_sha256"]
    stream, problems = RunRows.checked(rows, contract)
    assert problems == []
    assert sum(1 for _ in stream) == ROWS
    in_order, _ = RunRows.checked(rows, contract, indexed=False)  # lines read in file order
    assert in_order.index is None
    assert [r.row_sha256 for r in in_order] == [r.row_sha256 for r in stream]
    assert [r.data for r in in_order] == [r.data for r in stream]
    with rows.open("ab") as handle:
        handle.write(b"\n")
    for changed in (stream, in_order):
        with pytest.raises(TamperedLedger, match="changed after its rows were checked"):
            next(iter(changed))
