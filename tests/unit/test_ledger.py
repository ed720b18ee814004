"""The run ledger: canonical JSON, the hash chain, torn-line recovery, resume refusals,
``diff_fields`` and the derived CSV renderer. No model is loaded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.ledger import (
    GENESIS,
    RUN_FORMAT,
    Record,
    RunLedger,
    TamperedLedger,
    diff_fields,
    parse_rows,
    render_csv,
    write_text_atomic,
)

CONTRACT = {"run": {"model": "tiny", "plan": {"name": "short"}}, "items": {"digest": "ab"}}
HEADER = {"kvreplay_version": "0", "command": ["kvreplay", "run"]}


# ------------------------------------------------------------------ canonical JSON


def test_canonical_sorted_ascii_no_spaces() -> None:
    assert canonical({"b": 1, "a": [1, 2, {"d": None, "c": True}]}) == (
        b'{"a":[1,2,{"c":true,"d":null}],"b":1}'
    )
    assert canonical("é→") == b'"\\u00e9\\u2192"'
    assert canonical([1, 2, 3]) == b"[1,2,3]"
    assert canonical((1, 2)) == canonical([1, 2])


def test_canonical_independent_of_insertion_order() -> None:
    a = {"x": {"q": 1, "p": 2}, "y": [3]}
    b = {"y": [3], "x": {"p": 2, "q": 1}}
    assert canonical(a) == canonical(b)
    assert sha256_json(a) == sha256_json(b)


def test_sha256_json_is_the_release_token_commitment() -> None:
    assert sha256_json([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()


# ------------------------------------------------------------------------ chain


def make_ledger(tmp_path: Path, rows: int = 4) -> RunLedger:
    ledger = RunLedger(tmp_path / "run")
    ledger.start(CONTRACT, HEADER)
    for i in range(rows):
        ledger.append(f"exp/i{i}/bf16", "exp", {"item_id": f"i{i}", "value": i}, "w", {"s": 0.5})
    ledger.close()  # the run ends: another writer (a resume) may open the folder
    return ledger


def raw_lines(ledger: RunLedger) -> list[bytes]:
    return ledger.rows_path.read_bytes().splitlines(keepends=True)


def write_lines(ledger: RunLedger, lines: list[bytes]) -> None:
    ledger.rows_path.write_bytes(b"".join(lines))


def test_start_writes_manifest_before_rows(tmp_path: Path) -> None:
    ledger = RunLedger(tmp_path / "run")
    ledger.start(CONTRACT, HEADER)
    manifest = json.loads(ledger.manifest_path.read_text())
    assert manifest["format"] == RUN_FORMAT
    assert manifest["contract"] == CONTRACT
    assert manifest["contract_sha256"] == sha256_json(CONTRACT)
    assert manifest["command"] == HEADER["command"]
    assert not ledger.rows_path.exists()
    assert not list(ledger.run_dir.glob("*.tmp"))


def test_appended_rows_chain(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert problems == []
    assert [r.seq for r in records] == [0, 1, 2, 3]
    assert records[0].prev == GENESIS
    for before, after in zip(records, records[1:], strict=False):
        assert after.prev == before.hash
    for record in records:
        assert record.hash == record.expected_hash()
        assert record.contract == sha256_json(CONTRACT)
        assert record.to_line() == canonical({**record.body(), "hash": record.hash}).decode() + "\n"
    assert ledger.rows_path.read_text() == "".join(r.to_line() for r in records)


def test_row_hash_commits_to_every_field(tmp_path: Path) -> None:
    record = make_ledger(tmp_path, 1).records[0]
    for field, value in (
        ("seq", 7), ("key", "other"), ("experiment", "x"), ("data", {}), ("worker", "w2"),
        ("timing", {"s": 0.25}), ("prev", "1" * 64), ("contract", "2" * 64),
    ):  # fmt: skip
        changed = dataclasses.replace(record, **{field: value})
        assert changed.expected_hash() != record.hash, field


def test_edited_row_is_named(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lines = raw_lines(ledger)
    lines[1] = lines[1].replace(b'"value":1', b'"value":9')
    write_lines(ledger, lines)
    _, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert problems == ["row exp/i1/bf16 (line 2): field hash does not match the row's content"]


def test_edited_row_with_recomputed_hash_breaks_the_next_link(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record = ledger.records[1]
    forged = dataclasses.replace(record, data={**record.data, "value": 9})
    forged.hash = forged.expected_hash()
    lines = raw_lines(ledger)
    lines[1] = forged.to_line().encode()
    write_lines(ledger, lines)
    _, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert problems == ["row exp/i2/bf16 (line 3): field prev does not chain to the row before it"]


def test_deleted_row_names_the_row_after_it(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lines = raw_lines(ledger)
    del lines[1]
    write_lines(ledger, lines)
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert len(records) == 3
    assert problems == [
        "row exp/i2/bf16 (line 2): field prev does not chain to the row before it",
        "row exp/i2/bf16 (line 2): field seq is 2, expected 1",
        "row exp/i3/bf16 (line 3): field seq is 3, expected 2",
    ]


def test_deleted_last_row_is_invisible_to_the_chain(tmp_path: Path) -> None:
    """Truncation at a row boundary chains; audit's CSV check is what catches it."""
    ledger = make_ledger(tmp_path)
    write_lines(ledger, raw_lines(ledger)[:-1])
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert problems == [] and len(records) == 3


def test_reordered_rows_are_named(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lines = raw_lines(ledger)
    lines[1], lines[2] = lines[2], lines[1]
    write_lines(ledger, lines)
    _, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    named = {p.split(":")[0] for p in problems}
    assert named == {
        "row exp/i2/bf16 (line 2)",
        "row exp/i1/bf16 (line 3)",
        "row exp/i3/bf16 (line 4)",
    }
    assert "row exp/i2/bf16 (line 2): field prev does not chain to the row before it" in problems
    assert "row exp/i1/bf16 (line 3): field seq is 1, expected 2" in problems


def test_unparseable_line_and_foreign_contract(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lines = raw_lines(ledger)
    lines[0] = b'{"seq": 0, "key": "x"}\n'  # JSON, but not a ledger row
    write_lines(ledger, lines)
    _, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert problems[0] == "line 1: does not parse as a ledger row (TypeError)"
    _, problems = parse_rows(make_ledger(tmp_path / "b").rows_path, "f" * 64)
    assert len(problems) == 4
    assert all("field contract does not match the manifest" in p for p in problems)


def test_missing_rows_file_is_empty(tmp_path: Path) -> None:
    assert parse_rows(tmp_path / "rows.jsonl", "0" * 64) == ([], [])


# --------------------------------------------------------------- recover / resume


def test_recover_sets_a_torn_line_aside(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ledger = make_ledger(tmp_path, 3)
    intact = ledger.rows_path.read_bytes()
    torn = b'{"contract":"ab","data":{"item_'
    with ledger.rows_path.open("ab") as handle:
        handle.write(torn)
    again = RunLedger(ledger.run_dir)
    again.start(CONTRACT, HEADER)  # resume
    assert ledger.rows_path.read_bytes() == intact
    aside = list(ledger.run_dir.glob("rows.torn-*.jsonl"))
    assert len(aside) == 1 and aside[0].read_bytes() == torn
    assert f"set aside a torn last row in {aside[0].name}" in capsys.readouterr().err
    assert [r.key for r in again.records] == [r.key for r in ledger.records]
    assert again.is_done("exp/i2/bf16") and not again.is_done("exp/i3/bf16")
    record = again.append("exp/i3/bf16", "exp", {"value": 3}, "w", {})
    assert record.seq == 3 and record.prev == ledger.records[-1].hash
    assert parse_rows(again.rows_path, again.contract_hash)[1] == []


def test_parse_rows_ignores_a_torn_tail(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2)
    with ledger.rows_path.open("ab") as handle:
        handle.write(b'{"seq":2')
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    assert len(records) == 2 and problems == []


def test_recover_refuses_a_damaged_ledger(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lines = raw_lines(ledger)
    del lines[0]
    write_lines(ledger, lines)
    with pytest.raises(TamperedLedger, match=r"is damaged \(row exp/i1/bf16 \(line 1\)"):
        RunLedger(ledger.run_dir).start(CONTRACT, HEADER)


def test_resume_refuses_a_different_contract(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 1)
    before = ledger.manifest_path.read_bytes()
    other = {**CONTRACT, "run": {"model": "tiny", "plan": {"name": "instruct"}}}
    with pytest.raises(KvreplayError, match=r"different contract \(run\.plan\.name\)"):
        RunLedger(ledger.run_dir).start(other, HEADER)
    assert ledger.manifest_path.read_bytes() == before


def test_resume_ignores_the_header(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2)
    again = RunLedger(ledger.run_dir)
    again.start(CONTRACT, {"command": ["something", "else"], "created": "later"})
    assert again.manifest["command"] == HEADER["command"]
    assert len(again.records) == 2


def test_register_experiment_refuses_changed_settings(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 0)
    ledger.register_experiment("exp", {"item_ids": ["a", "b"], "dtypes": ("bf16",)})
    ledger.register_experiment("exp", {"dtypes": ["bf16"], "item_ids": ["a", "b"]})  # same
    with pytest.raises(KvreplayError, match=r"already ran exp with different settings"):
        ledger.register_experiment("exp", {"item_ids": ["a"], "dtypes": ["bf16"]})
    manifest = json.loads(ledger.manifest_path.read_text())
    assert manifest["experiments"]["exp"]["config"] == {"item_ids": ["a", "b"], "dtypes": ["bf16"]}


def test_append_refuses_a_duplicate_key(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 1)
    with pytest.raises(KvreplayError, match="already in the ledger"):
        ledger.append("exp/i0/bf16", "exp", {}, "w", {})
    assert len(raw_lines(ledger)) == 1


def test_open_existing_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(KvreplayError, match="is not a kvreplay run"):
        RunLedger.open_existing(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(KvreplayError, match="is not a kvreplay run manifest"):
        RunLedger.open_existing(tmp_path)


def test_start_refuses_an_unwritable_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(KvreplayError, match="is not writable"):
        RunLedger(tmp_path / "file" / "run").start(CONTRACT, HEADER)


def test_rows_filters_by_experiment(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2)
    ledger.append("other/x", "other", {}, "w", {})
    assert [r.key for r in ledger.rows("other")] == ["other/x"]
    assert list(ledger.by_key()) == ["exp/i0/bf16", "exp/i1/bf16", "other/x"]
    assert [r.key for r in ledger.records] == list(ledger.by_key())


# ---------------------------------------------------------------------- diff_fields


def test_diff_fields_paths() -> None:
    old = {"a": 1, "b": {"c": [1, 2, {"d": 3}]}, "e": "x", "gone": 0}
    new = {"a": 1, "b": {"c": [1, 5, {"d": 4}]}, "e": "y", "added": 0}
    assert diff_fields(old, new) == ["added", "b.c[1]", "b.c[2].d", "e", "gone"]


def test_diff_fields_edge_cases() -> None:
    assert diff_fields({"a": [1, 2]}, {"a": [1, 2]}) == []
    assert diff_fields({"a": [1, 2]}, {"a": [1, 2, 3]}) == ["a"]  # lengths differ: whole list
    assert diff_fields(1, 2) == ["<root>"]
    assert diff_fields({"a": 1}, [1]) == ["<root>"]
    assert diff_fields({"a": {"b": 1}}, {"a": 1}, "x") == ["x.a"]
    assert diff_fields({1: "a"}, {1: "b"}) == ["1"]


# ----------------------------------------------------------------------- render_csv


def test_render_csv_is_deterministic() -> None:
    columns = ["row_id", "flag", "json", "empty"]
    rows = [
        {"row_id": "r1", "flag": "true", "json": "[1.0, 2.0]", "empty": ""},
        {"flag": "false", "row_id": "r2", "json": 'say "hi"'},  # key order, missing key
    ]
    text = render_csv(columns, rows)
    assert text == 'row_id,flag,json,empty\nr1,true,"[1.0, 2.0]",\nr2,false,"say ""hi""",\n'
    assert render_csv(columns, [dict(reversed(list(r.items()))) for r in rows]) == text
    assert render_csv(columns, []) == "row_id,flag,json,empty\n"


def test_render_csv_refuses_unknown_columns() -> None:
    with pytest.raises(ValueError):
        render_csv(["a"], [{"a": "1", "b": "2"}])


def test_write_text_atomic(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    path.write_text("old")
    write_text_atomic(path, "new ✓\n")
    assert path.read_text(encoding="utf-8") == "new ✓\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]


def test_spliced_row_hash_is_the_canonical_body_hash() -> None:
    """expected_hash encodes the data once for both digests; it must equal the hash of
    the body's canonical JSON whatever the other fields hold."""
    from kvreplay.core.canonical import sha256_json

    for contract in ("c" * 64, 'a"data":null', ""):
        record = Record(
            seq=3, key="k", experiment="e", data={"z": [1, 2.5], "a": {"b": None}},
            worker="w", timing={"s": 0.5}, prev="0" * 64, contract=contract, hash="",
        )  # fmt: skip
        assert record.expected_hash() == sha256_json(record.body())
        assert record.row_sha256 == sha256_json(record.data)
