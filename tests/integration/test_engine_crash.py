"""An engine that dies by a signal in the middle of a run (issue 48): the command line says
which engine died, with which signal and on which row, in one sentence with exit code 2;
the rows written before it are intact, and the same command resumes after them. The
signal is a real one sent to the process running the engine (a crash in native code
ends a process the same way)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import save_tiny

COMMAND = [sys.executable, "-c", "from kvreplay.cli import main; main()"]
BAR = re.compile(r"^\S+:\s+\d+%\|")  # a progress bar's line


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def errors(stderr: str) -> list[str]:
    """What stderr says beside the progress bar (which a dead process leaves unended)."""
    lines = stderr.replace("kvreplay: error:", "\nkvreplay: error:").replace("\r", "\n")
    return [line for line in lines.splitlines() if line.strip() and not BAR.match(line)]


def rows_of(out: Path) -> list[bytes]:
    try:
        return [line for line in (out / "rows.jsonl").read_bytes().splitlines(keepends=True)
                if line.endswith(b"\n")]  # fmt: skip
    except OSError:
        return []


def kill_after_rows(command: list[str], out: Path, rows: int, victim) -> tuple[int, str, list]:
    """Start ``command``, send SIGSEGV to ``victim(pid)`` once ``rows`` rows are written;
    return its exit code, stderr and the rows there were then."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while len(rows_of(out)) < rows:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    before = rows_of(out)
    target = victim(process.pid)
    assert target, "no process to kill"
    os.kill(target, signal.SIGSEGV)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr.decode(), before


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("crash") / "model", "qwen2")


@pytest.mark.skipif(sys.platform != "linux", reason="the watch is Linux's")
def test_an_engine_killed_mid_run_is_one_sentence_and_the_rerun_resumes(
    model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = [*COMMAND, "run", "matched", "--model", str(model), "--plan", "short",
           "--dtypes", "fp32", "--n", "24", "--out", str(out)]  # fmt: skip

    def engine(pid: int) -> int | None:  # the watched child that runs the engine
        found = children(pid)
        return found[0] if found else None

    code, stderr, before = kill_after_rows(run, out, 2, engine)
    assert code == 2, stderr
    lines = errors(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("kvreplay: error: The hf engine died with SIGSEGV (signal 11")
    assert "while running row matched/" in lines[0] and str(out) in lines[0]
    kept = rows_of(out)
    assert kept[: len(before)] == before  # nothing written before the death was lost
    assert f"the {len(kept)} row(s) before it are kept" in lines[0]
    again = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    done = rows_of(out)
    assert len(done) == 24 and done[: len(kept)] == kept
    audited = subprocess.run([*COMMAND, "audit", str(out), "--sample", "0"],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert audited.returncode == 0 and "PASS" in audited.stdout, audited.stdout + audited.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the watch is Linux's")
def test_a_worker_process_killed_mid_run_names_its_signal(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = [*COMMAND, "run", "matched", "--model", str(model), "--plan", "short",
           "--dtypes", "fp32", "--n", "24", "--workers", "2", "--out", str(out)]  # fmt: skip

    def worker(pid: int) -> int | None:  # a worker process of the watched child
        for child in children(pid):
            found = children(child)
            if found:
                return found[-1]
        return None

    code, stderr, _ = kill_after_rows(run, out, 1, worker)
    assert code == 2, stderr
    lines = errors(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "Worker process local-" in lines[0] and "(the hf engine) died with SIGSEGV" in lines[0]
    assert "rerunning the same command resumes after them" in lines[0]
