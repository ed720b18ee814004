"""What the hostile probes (``hostile_probe.py`` and ``hostile_round3.py``) share: the key
they plant, the wrong values they try, a family's tally and what counts as a clean
refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import Result

KEY_ENV, SECRET = "KVREPLAY_PROBE_KEY", "sk-probe-0123456789abcdef"
# Values of the wrong type or range for any field (None: the field left out).
WRONG: tuple[Any, ...] = (None, "x", "", -1, 10**9, 10**30, 1.5, True, [], {}, [1], {"a": 1},
                          float("nan"), float("inf"), "\x1b[2J\n", "y" * 5000)  # fmt: skip


class Family:
    """The cases of one family and how each ended."""

    def __init__(self, name: str) -> None:
        self.name, self.tried, self.left = name, 0, []

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
