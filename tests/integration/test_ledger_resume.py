"""Resume after a crash (issue 6): SIGKILL a real ``kvreplay run`` process part-way, leave
a torn last line as a crash mid-append would, rerun the same command, and compare the
ledger with an uninterrupted run's: the same rows in the same order, same fingerprints.

Runs use one torch thread (``OMP_NUM_THREADS=1`` in the subprocesses, ``set_num_threads``
in process) so that all of them share one contract and the oversubscribed CI box stays fast.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import DTYPES, invoke

from kvreplay.core.canonical import sha256_json
from kvreplay.ledger import parse_rows

N = 6
TOTAL = 2 * N
TORN = b'{"contract":"0123","data":{"all_storage_disjoint":tr'
# Record fields that hold wall time, or commit to it, so differ between any two runs.
TIMED = {"timing", "hash", "prev", "worker"}


@pytest.fixture(scope="module")
def model(tiny_dirs: dict[str, Path]) -> Path:
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("items") / "items.jsonl"
    prompts = ["What is 2+3?", "Compute 4*5.", "hello world", "Add 10 and 12.", "9-4=?", "7*7?"]
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": p, "answer": "1"}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def args(out: Path, model: Path, items: Path, n: int = N, plan: str = "short") -> list[str]:
    return [
        "run", "matched", "--model", str(model), "--items", str(items), "--n", str(n),
        "--dtypes", ",".join(DTYPES), "--plan", plan, "--out", str(out),
    ]  # fmt: skip


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def command(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", "from kvreplay.cli import main; main()", *argv]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, model: Path, items: Path) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = invoke(*args(out, model, items))
    assert result.exit_code == 0, (result.output, result.exception)
    return out


@pytest.fixture(scope="module")
def resumed(
    tmp_path_factory: pytest.TempPathFactory, model: Path, items: Path
) -> tuple[Path, int, str]:
    """A run killed after >= 2 rows, given a torn last line, then rerun to completion."""
    out = tmp_path_factory.mktemp("killed") / "run"
    argv = args(out, model, items)
    log = out.parent / "killed.stderr"  # a file, not a pipe: a full pipe would block the run
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            command(argv), env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=stderr
        )
    deadline = time.monotonic() + 600
    try:
        while line_count(out / "rows.jsonl") < 2:
            if proc.poll() is not None:
                pytest.fail(f"the run ended before it was killed: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the run wrote fewer than 2 rows in 600 s")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = line_count(out / "rows.jsonl")
    assert 2 <= done < TOTAL, "the kill must land part-way"
    assert not (out / "matched_live_prefill.csv").exists()
    with (out / "rows.jsonl").open("ab") as handle:  # a crash in the middle of an append
        handle.write(TORN)
    # The same command again, to completion (in process: a second interpreter start costs
    # ~10 s on a loaded box; its contract, threads included, must equal the killed run's).
    rerun = invoke(*argv)
    assert rerun.exit_code == 0, (rerun.output[-3000:], rerun.exception)
    return out, done, rerun.stderr


def test_resumed_run_equals_uninterrupted_run(
    resumed: tuple[Path, int, str], uninterrupted: Path
) -> None:
    out, done_before_kill, _ = resumed
    got, want = records(out), records(uninterrupted)
    keys = [r["key"] for r in got]
    assert keys == [r["key"] for r in want]
    assert len(keys) == len(set(keys)) == TOTAL
    assert [r["seq"] for r in got] == list(range(TOTAL))
    for a, b in zip(got, want, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMED} == {
            k: v for k, v in b.items() if k not in TIMED
        }, a["key"]
        for arm in a["data"]["arms"]:  # spelled out: the fingerprints the issue names
            for field in ("cache_fingerprint", "logits_fingerprint", "suffix_sha256"):
                assert a["data"]["arms"][arm][field] == b["data"]["arms"][arm][field]
        assert a["data"]["comparison"] == b["data"]["comparison"]
    manifest = json.loads((out / "manifest.json").read_text())
    reference = json.loads((uninterrupted / "manifest.json").read_text())
    assert manifest["contract"] == reference["contract"]  # same threads, versions, digests
    assert (
        manifest["experiments"]["matched"]["config"]
        == (reference["experiments"]["matched"]["config"])
    )
    _, problems = parse_rows(out / "rows.jsonl", manifest["contract_sha256"])
    assert problems == []
    assert done_before_kill < TOTAL


def test_resumed_csv_equals_uninterrupted_csv(
    resumed: tuple[Path, int, str], uninterrupted: Path
) -> None:
    """Byte-identical: ``source_row_sha256`` commits to a row's content, not its timing."""
    out, _, _ = resumed
    a = (out / "matched_live_prefill.csv").read_text()
    assert a == (uninterrupted / "matched_live_prefill.csv").read_text()
    by_key = {r["key"]: sha256_json(r["data"]) for r in records(out)}
    table = list(csv.DictReader(io.StringIO(a)))
    assert [r["source_row_sha256"] for r in table] == [
        by_key[f"matched/{r['row_id']}/{r['precision']}"] for r in table
    ]


def test_torn_line_set_aside(resumed: tuple[Path, int, str]) -> None:
    out, _, stderr = resumed
    torn = sorted(out.glob("rows.torn-*.jsonl"))
    assert len(torn) == 1
    assert torn[0].read_bytes().endswith(TORN)
    assert b"\n" not in torn[0].read_bytes()
    assert f"set aside a torn last row in {torn[0].name}" in stderr
    assert (out / "rows.jsonl").read_bytes().endswith(b"\n")


def test_resume_refuses_a_different_contract(
    resumed: tuple[Path, int, str], model: Path, items: Path, tiny_dirs: dict[str, Path]
) -> None:
    out, _, _ = resumed
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for argv, field in (
        (args(out, model, items, plan="instruct"), "plan"),
        (args(out, tiny_dirs["qwen2"], items), "model"),
    ):
        result = invoke(*argv)
        assert result.exit_code == 2, result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvreplay: error:"), result.stderr
        assert "different contract" in lines[0] and field in lines[0]
        assert "Traceback" not in result.output
    result = invoke(*args(out, model, items, n=N - 1))
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "already ran matched with different settings" in lines[0]
    assert "item_ids" in lines[0]
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # a refusal writes nothing


def test_a_run_recorded_before_schema_versions_resumes_as_version_1(
    uninterrupted: Path, tmp_path: Path, model: Path, items: Path
) -> None:
    """A run whose config records no CSV schema version (made before versions) is
    version 1: a resume neither refuses it nor records a version, and its CSV stays."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("manifest.json", "items.jsonl", "rows.jsonl"):
        (out / name).write_bytes((uninterrupted / name).read_bytes())
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["experiments"]["matched"]
    assert entry["config"].pop("schema_version") == 1
    entry["config_sha256"] = sha256_json(entry["config"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    result = invoke(*args(out, model, items))
    assert result.exit_code == 0, result.output
    config = json.loads((out / "manifest.json").read_text())["experiments"]["matched"]["config"]
    assert "schema_version" not in config
    csv_name = "matched_live_prefill.csv"
    assert (out / csv_name).read_text() == (uninterrupted / csv_name).read_text()
