"""`kvreplay analyze` and `kvreplay report` on a run folder load no torch or transformers
(the tables, typed rows and sections they read are plain data), and neither does the
command line itself: a command that takes the backends' options makes them only when it
is used, and making them (importing every backend's class) loads no torch either."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import invoke

RUN = Path(__file__).resolve().parents[2] / "results" / "smollm2-n24"
PROBE = """
import atexit, sys
heavy = ("torch", "transformers")
atexit.register(lambda: print("loaded:" + ",".join(m for m in heavy if m in sys.modules)))
from kvreplay.cli import main
sys.argv = ["kvreplay", *sys.argv[1:]]
main()
"""


def loaded(*argv: str) -> str:
    """The heavy modules a fresh ``kvreplay ARGV`` process has imported when it ends."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1].removeprefix("loaded:")


@pytest.mark.skipif(not (RUN / "rows.jsonl").is_file(), reason=f"{RUN} is absent")
@pytest.mark.parametrize("command", ["analyze", "report"])
def test_analysis_of_a_run_loads_no_torch(command: str, tmp_path: Path) -> None:
    run = tmp_path / RUN.name
    shutil.copytree(RUN, run)
    assert loaded(command, str(run), "-o", str(tmp_path / "out")) == ""


def test_help_loads_no_torch_and_a_run_command_still_takes_every_backends_options() -> None:
    assert loaded("--help") == ""
    for argv in (["run", "matched", "--help"], ["check", "--help"]):
        text = invoke(*argv).output
        assert "--backend" in text and "--url" in text, argv
    assert "--url" in invoke("audit", "--help").output


@pytest.mark.parametrize("argv", [["backends"], ["run", "matched", "--help"]])
def test_naming_the_backends_loads_no_torch(argv: list[str]) -> None:
    assert loaded(*argv) == ""
