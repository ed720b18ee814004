"""``kvreplay audit`` (issue 6): an untouched run passes; every kind of tampering is named
(row and field); a folder that is not a run is bad input.

One small run with snapshots is built per module and copied per test.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
import re
from pathlib import Path

import pytest
from forgery import CSV, assert_named, audit, problems


def lines(run: Path) -> list[bytes]:
    return (run / "rows.jsonl").read_bytes().splitlines(keepends=True)


def keys(run: Path) -> list[str]:
    return [json.loads(line)["key"] for line in lines(run)]


def digest_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_built_run_has_snapshots(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["snapshots"] == "saved"
    assert len(keys(built)) == 4
    assert len(list((built / "snapshots").glob("*.safetensors"))) == 16  # 4 arms x 4 rows


def test_untouched_run_passes_and_audit_is_read_only(run: Path) -> None:
    before = digest_tree(run)
    result = audit(run)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    assert "rows in ledger: 4; re-executed: 4" in result.stdout
    assert "environment differs" not in result.stdout
    assert digest_tree(run) == before


def test_sample_reexecutes_exactly_k_rows(run: Path) -> None:
    result = audit(run, "--sample", 2, "--seed", 1)
    assert result.exit_code == 0, result.output
    assert "rows in ledger: 4; re-executed: 2" in result.stdout


def test_flipped_byte_in_a_row_is_named(run: Path) -> None:
    rows = lines(run)
    target = 1
    key = json.loads(rows[target])["key"]
    match = re.search(rb'"cache_fingerprint":"([0-9a-f]{64})"', rows[target])
    assert match is not None
    at = match.start(1)
    flipped = b"1" if rows[target][at : at + 1] != b"1" else b"2"
    rows[target] = rows[target][:at] + flipped + rows[target][at + 1 :]
    json.loads(rows[target])  # still valid JSON: only the content check can catch it
    (run / "rows.jsonl").write_bytes(b"".join(rows))
    result = audit(run)
    assert_named(result, f"row {key}", "arms.left.cache_fingerprint")
    assert_named(result, f"row {key}", "field hash")
    item_id = key.split("/")[1]  # the derived CSV names the row by its item id
    assert all(p.startswith(f"row {key}") or item_id in p for p in problems(result))
    assert_named(result, f"row {key}", "snapshot", "cache_fingerprint")  # and its snapshot


def test_deleted_row_names_the_row_after_it(run: Path) -> None:
    rows, names = lines(run), keys(run)
    del rows[1]
    (run / "rows.jsonl").write_bytes(b"".join(rows))
    result = audit(run)
    assert_named(result, f"row {names[2]}", "field prev")
    assert_named(result, f"row {names[2]}", "field seq")
    assert_named(result, CSV)  # the CSV still holds the deleted row


def test_reordered_rows_are_named(run: Path) -> None:
    rows, names = lines(run), keys(run)
    rows[1], rows[2] = rows[2], rows[1]
    (run / "rows.jsonl").write_bytes(b"".join(rows))
    result = audit(run)
    assert_named(result, f"row {names[2]}", "field prev")
    assert_named(result, f"row {names[1]}", "field prev")


def test_edited_csv_cell_is_named(run: Path) -> None:
    path = run / CSV
    original = path.read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(original))
    columns, table = list(reader.fieldnames or []), list(reader)

    def render(rows: list[dict[str, str]]) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    assert render(table) == original
    row = table[2]
    row["prefix_token_count"] = str(int(row["prefix_token_count"]) + 1)
    path.write_text(render(table), encoding="utf-8")
    result = audit(run, "--sample", 1)
    assert_named(
        result, CSV, f"row {row['row_id']} ({row['precision']})", "field prefix_token_count"
    )
    assert all(p.startswith(CSV) for p in problems(result))


def test_altered_snapshot_is_named(run: Path) -> None:
    record = json.loads(lines(run)[3])
    entry = record["data"]["arms"]["prefill"]["snapshot"]
    path = run / entry["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a bit of the last tensor's data
    path.write_bytes(bytes(data))
    result = audit(run, "--sample", 1)
    assert_named(result, f"row {record['key']}", f"snapshot {entry['file']}", "field sha256")


def test_missing_snapshot_is_named(run: Path) -> None:
    record = json.loads(lines(run)[0])
    entry = record["data"]["arms"]["left_replica"]["snapshot"]
    (run / entry["file"]).unlink()
    result = audit(run, "--sample", 1)
    assert_named(result, f"row {record['key']}", entry["file"], "missing")


@pytest.mark.parametrize("setup", ["empty", "bad_json", "not_kvreplay", "missing"])
def test_a_folder_that_is_not_a_run_is_bad_input(tmp_path: Path, setup: str) -> None:
    folder = tmp_path / "folder"
    if setup != "missing":
        folder.mkdir()
    if setup == "bad_json":
        (folder / "manifest.json").write_text("{not json")
    if setup == "not_kvreplay":
        (folder / "manifest.json").write_text('{"format": "something-else"}')
    result = audit(folder)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines_ = result.stderr.splitlines()
    assert len(lines_) == 1 and lines_[0].startswith("kvreplay: error:"), result.stderr
    assert str(folder) in lines_[0]
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_audit_elsewhere_names_the_environment_fields_that_differ(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")  # the run recorded x86_64
    result = audit(run, "--sample", 0)  # the structural checks only
    assert result.exit_code == 0, result.output
    assert re.search(r"platform: differs from the recorder's in .*\bmachine\b", result.stdout)
    assert "rows in ledger: 4; re-executed: 0" in result.stdout


def test_audit_on_another_thread_count_is_refused(run: Path) -> None:
    """The run recorded one thread; the refusal names the flag that restores it."""
    result = audit(run, "--sample", 0, "--threads", 2)
    assert result.exit_code == 2
    assert "recorded 1 thread per worker process" in result.stderr
    assert "pass --threads 1 to audit it" in result.stderr
