"""One writer per run folder (issue 11): a second ``kvreplay run`` on a folder that a
live process holds is refused with one sentence and writes nothing; a killed writer
leaves no stuck lock. Real processes: the lock is the operating system's."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import assert_one_sentence, good_lines, jsonl

from kvreplay.audit.audit import audit


def command(model: Path, items: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-c", "from kvreplay.cli import main; main()", "run", "matched",
        "--model", str(model), "--items", str(items), "--plan", "short",
        "--dtypes", "bf16,fp32", "--out", str(out),
    ]  # fmt: skip


def start(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(  # a group of its own: kvreplay and the child it watches
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def wait_for_a_row(out: Path, process: subprocess.Popen[str]) -> None:
    rows = out / "rows.jsonl"
    deadline = time.monotonic() + 240
    while not (rows.exists() and rows.read_bytes().count(b"\n") >= 1):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_second_writer_is_refused_and_the_ledger_stays_intact(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    items = jsonl(tmp_path / "items.jsonl", good_lines())
    out = tmp_path / "out"
    args = command(tiny_dirs["qwen2"], items, out)
    first = start(args)
    try:
        wait_for_a_row(out, first)
        os.killpg(first.pid, signal.SIGSTOP)  # hold it mid-run, lock held, deterministically
        before = tree(out)
        second = subprocess.run(
            args, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert_one_sentence(second.stderr, "Another kvreplay process is writing to")
        assert tree(out) == before  # the refused process wrote nothing
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    keys = [json.loads(line)["key"] for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 6  # 3 items x 2 precisions, none twice
    result = audit(out)
    assert result.passed, result.problems


def test_a_killed_writer_leaves_no_stuck_lock(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    items = jsonl(tmp_path / "items.jsonl", good_lines())
    out = tmp_path / "out"
    args = command(tiny_dirs["qwen2"], items, out)
    first = start(args)
    wait_for_a_row(out, first)
    first.kill()
    first.communicate()
    resumed = subprocess.run(
        args, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert audit(out).passed
