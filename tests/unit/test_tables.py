"""Tables (experiments/table.py): one declaration per CSV, read and written alike; a run
renders the columns of the schema version its config records (none recorded: 1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvreplay.experiments.matrix.table import MATCHED_TABLE, SERVED_MATCHED_TABLE
from kvreplay.experiments.registry import recorded_table, table_for
from kvreplay.harness.columns import Column, Field
from kvreplay.harness.table import SCHEMA_VERSION, Table, _Keys, read_ledger, recorded_version
from kvreplay.ledger import GENESIS, Record

RESULTS = Path(__file__).resolve().parents[2] / "results"
RUNS = sorted(p for p in RESULTS.iterdir() if (p / "manifest.json").is_file())


def _versioned() -> Table:
    """A table whose second version added a column."""
    return Table(
        "demo.csv",
        (
            Column("row_id", "text", get=lambda x: x["id"]),
            Column("value", "int", get=lambda x: x["value"]),
            Column("note", "optional_text", "written", since=2, get=lambda x: x.get("note")),
        ),
        "demo",
        lambda rows: [r.data for r in rows],
    )


def _record(data: dict) -> Record:
    return Record(0, "demo/a/bf16", "demo", data, "w0", {}, GENESIS, "0" * 64, "")


def test_a_run_without_a_recorded_version_renders_version_1() -> None:
    table, rows = _versioned(), [_record({"id": "a", "value": 3, "note": "later"})]
    assert table.version == 2
    assert recorded_version({}) == 1
    assert table.header({}) == ["row_id", "value"]
    assert table.csv(rows, {}) == "row_id,value\na,3\n"
    assert table.csv(rows, {SCHEMA_VERSION: 2}) == "row_id,value,note\na,3,later\n"


def test_a_new_run_records_the_latest_version_and_a_resumed_one_keeps_its_own() -> None:
    table = _versioned()
    assert table.stamp({"n": 1}, None) == {"n": 1, SCHEMA_VERSION: 2}
    assert table.stamp({"n": 1}, {"n": 1, SCHEMA_VERSION: 1}) == {"n": 1, SCHEMA_VERSION: 1}
    assert table.stamp({"n": 1}, {"n": 1}) == {"n": 1}  # recorded before versions: 1


def test_a_column_added_later_cannot_be_required() -> None:
    with pytest.raises(AssertionError, match="was added later"):
        Field("note", "text", "required", since=2)


def test_a_served_run_is_read_and_derived_as_the_served_table(tmp_path: Path) -> None:
    header = ",".join(c.name for c in SERVED_MATCHED_TABLE.columns)
    (tmp_path / MATCHED_TABLE.file).write_text(header + "\n")
    assert table_for(tmp_path / MATCHED_TABLE.file) is SERVED_MATCHED_TABLE
    assert table_for(Path(MATCHED_TABLE.file)) is MATCHED_TABLE
    served = json.loads((RESULTS / "smollm2-http-n24-bf16" / "manifest.json").read_text())
    assert recorded_table("matched", served) is SERVED_MATCHED_TABLE
    old_hf = {"attn_implementation": "sdpa", "trust_remote_code": False}  # named no backend
    assert recorded_table("matched", {"contract": {"run": old_hf}}) is MATCHED_TABLE
    assert recorded_table("bridge", served) is None  # the bridge reads K/V


@pytest.mark.parametrize("run", RUNS, ids=[run.name for run in RUNS])
def test_every_committed_csv_holds_its_declared_kinds_in_every_column(run: Path) -> None:
    """Every column, read or only written, parses as its kind (the gates aside); a table
    holds its held columns, and its lines again have every one."""
    for path in sorted(run.glob("*.csv")):
        table = table_for(path)
        assert table is not None, path
        every = tuple(replace(c, use="required") for c in table.columns if c.since == 1)
        ledger = read_ledger(path, replace(table, columns=every, checks=(), line_checks=()))
        if table.held:
            held = {c.name for c in every if c.held}
            assert set(ledger.held) == held - {"row_id"}
        assert all(set(line) == {c.name for c in every} for line in ledger.lines())


@pytest.mark.parametrize(
    ("repeats", "named"),
    [
        ({9000: 3, 9100: 8000, 9050: 9040}, 9000),  # an earlier chunk's key first
        ({8300: 10, 8200: 8195}, 8200),  # a key of its own chunk first
        ({4095: 0}, 4095),  # the last line of a chunk
        ({9999: 9998}, 9999),  # the last line, checked when the lines end
        ({19_000: 10, 19_500: 16_390}, 19_000),  # a key of a run merged from four chunks first
        (
            {19_500: 12_300, 19_600: 17_000},
            19_500,
        ),  # a merged run's key, then its own chunk's
    ],
)
def test_a_key_seen_twice_is_named_by_the_first_line_that_repeats_one(
    repeats: dict[int, int], named: int
) -> None:
    """Keys are held as digests and checked a chunk of lines at a time; the line named
    is the one a set checked line by line would name."""
    keys, found = _Keys(), []
    for line in range(20_000):
        found.append(keys.add(f"k{repeats.get(line, line)}", f"line{line}"))
    found.append(keys.check())
    assert [f for f in found if f is not None][0] == f"line{named}"


def test_keys_all_different_pass_every_check() -> None:
    keys = _Keys()
    assert all(keys.add(f"k{line}", f"line{line}") is None for line in range(9_000))
    assert keys.check() is None and keys.count == 9_000
