"""What the hostile probes (``hostile_probe.py``, ``hostile_round3.py`` and
``hostile_round4.py``) share: the key they plant, the wrong values they try, a family's
tally, a command cut off when it hangs, and what counts as a clean refusal or a named
forgery."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

from click.testing import Result
from helpers import invoke

CASE_SECONDS = int(os.environ.get("HOSTILE_CASE_SECONDS", "120"))
KEY_ENV, SECRET = "KVREPLAY_PROBE_KEY", "sk-probe-0123456789abcdef"
# Values of the wrong type or range for any field (None: the field left out).
WRONG: tuple[Any, ...] = (None, "x", "", -1, 10**9, 10**30, 1.5, True, [], {}, [1], {"a": 1},
                          float("nan"), float("inf"), "\x1b[2J\n", "y" * 5000)  # fmt: skip


class Family:
    """The cases of one family and how each ended."""

    def __init__(self, name: str) -> None:
        self.name, self.tried, self.left = name, 0, []
        self.reexecuted: list[str] = []  # clean only once the audit re-executed rows

    def record(self, case: str, problem: str | None) -> None:
        self.tried += 1
        if problem is not None:
            self.left.append(f"{case}: {problem}")

    def line(self) -> str:
        clean = self.tried - len(self.left)
        return f"{self.name:<24} tried {self.tried:>4}  clean {clean:>4}  left {len(self.left)}"


def refusal(result: Result) -> str | None:
    """None when the command ended in one sentence and exit 2, else what it did."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"{type(result.exception).__name__} (a traceback)"
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("kvreplay: error: ")]
    if result.exit_code != 2 or len(errors) != 1 or lines[-1] != errors[0]:
        return f"exit {result.exit_code}: {result.output[-160:]!r}"
    return None


def made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def timed(*args: object) -> Result:
    """``kvreplay ARGS`` cut off after :data:`CASE_SECONDS` (a hang is a problem too)."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"no answer within {CASE_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(CASE_SECONDS)
    try:
        return invoke(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def digests(*paths: Path) -> dict[Path, str | None]:
    """Each protected file's bytes (its digest), None where it is not a regular file."""
    found: dict[Path, str | None] = {}
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            regular = file.is_file() and not file.is_symlink()
            found[file] = hashlib.sha256(file.read_bytes()).hexdigest() if regular else None
    return found


def refused(result: Result, before: dict[Path, str | None], out: Path | None = None) -> str | None:
    """None when ``result`` is one sentence and exit 2, the protected files unchanged and
    (``out``) no manifest written; else what it did."""
    problem = refusal(result)
    if problem is None and digests(*before) != before:
        problem = "a protected file changed"
    if problem is None and out is not None and (out / "manifest.json").exists():
        problem = "a manifest was left"
    return problem


def named(result: Result, needle: str) -> str | None:
    """None when an audit exits 1 naming ``needle`` or refuses in one sentence."""
    if result.exit_code == 1 and any(
        line.startswith("  - ") and needle in line for line in result.stdout.splitlines()
    ):
        return None
    if result.exit_code == 2:
        return refusal(result)
    problem = refusal(result) if result.exception else None
    return problem or f"exit {result.exit_code}, {needle!r} not named"
