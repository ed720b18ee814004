"""A command that runs an engine runs in a child process that this one watches (design: a
crash is a sentence). llama.cpp, vLLM's CPU kernels and torch are native code: a crash
there (a segmentation fault, an instruction the CPU lacks, the kernel's out-of-memory
killer) ends the process that ran them without a word, and a user reads exit code 139
and a half-written folder. Watched, the same crash ends in one sentence naming the engine,
the signal and the row it was on, exit code 2; the rows written before it stay (each was
fsynced when written) and rerunning the command resumes after them.

Only the command-line program is watched (the ``kvreplay`` script and ``python -m
kvreplay``); a program that calls kvreplay's API runs it in its own process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvreplay.engines.watch import WATCH, last
from kvreplay.ledger import ROWS

# The commands that run an engine (and so may die with it).
WATCHED = ("run", "check", "audit", "demo")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CAUSES = {
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "native code that aborted",
    signal.SIGILL: "an instruction this CPU lacks (a build for another CPU)",
    signal.SIGKILL: "a kill, often the kernel's out-of-memory killer",
}


def watched(argv: list[str]) -> bool:
    """Whether ``argv`` runs in a watched child: an engine command, on Linux, not already
    inside one."""
    return sys.platform == "linux" and bool(argv) and argv[0] in WATCHED and WATCH not in os.environ


def supervise(argv: list[str]) -> tuple[int, str | None]:
    """Run ``kvreplay argv`` in a watched child: its exit code, or 2 and the sentence
    that says how it died."""
    with tempfile.TemporaryDirectory(prefix="kvreplay-watch-") as folder:
        watch = Path(folder) / "watch.json"
        child = subprocess.Popen(
            [*_program(), *argv],
            env={**os.environ, WATCH: str(watch)},
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - this process runs no threads
        )
        code = _wait(child)
        if code >= 0:
            return code, None
        return 2, died(argv[0], signal.Signals(-code), last(watch))


def _program() -> list[str]:
    """The program this process is, to run again as the child: the script it was started
    as (the ``kvreplay`` script, or a wrapper of the caller's that sets things up first),
    else ``python -m kvreplay``."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script and script.is_file() and script.name != "__main__.py":
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "kvreplay"]


def died(command: str, sig: signal.Signals, noted: dict[str, str]) -> str:
    """The sentence of a child that ``sig`` ended, from its last note."""
    how = f"died with {sig.name} (signal {int(sig)}, {CAUSES.get(sig, 'a signal')})"
    row, run = noted.get("row"), noted.get("run")
    if not row:
        return (
            f"kvreplay {command} {how} before it ran any row (while it loaded the model or "
            "started the engine); rerun the same command once the cause is fixed."
        )
    where = f"while running row {row} of {run}"
    if command == "audit":
        return f"The {noted.get('engine')} engine {how} {where}; the audit wrote nothing."
    kept = _rows(Path(run or ""))
    return (
        f"The {noted.get('engine')} engine {how} {where}; the {kept} row(s) before it are "
        "kept, and rerunning the same command resumes after them."
    )


def _rows(run: Path) -> int:
    try:
        with (run / ROWS).open("rb") as rows:
            return sum(1 for line in rows if line.endswith(b"\n"))
    except OSError:
        return 0


def _wait(child: subprocess.Popen) -> int:
    """The child's exit code. Ctrl-C reaches the child from the terminal and is its to
    handle; a termination asked of this process is passed on to it."""

    def forward(number: int, frame: object) -> None:
        child.send_signal(number)

    handlers = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGHUP: signal.signal(signal.SIGHUP, forward),
    }
    try:
        return child.wait()
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def _die_with_parent() -> None:
    """A child whose supervisor is killed outright is terminated with it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
