"""docs/quickstart.md runs as written: every ``bash`` block, in order, in a fresh folder,
with ``MODEL`` (which the page documents) set to drift_qwen2, the tiny model whose prefill
drifts from decode by construction, so the check fails there as it does on the embedded
model. The comment before a block says the exit code it must end with and the files it
must write (``<!-- expect: exit 1; writes a b -->``; without one, exit 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kvreplay

TESTS = Path(__file__).resolve().parents[1]
PAGE = TESTS.parent / "docs" / "quickstart.md"
BLOCK = re.compile(r"(?:<!-- expect: (?P<expect>[^>]*?) -->\n)?```bash\n(?P<code>.*?)```", re.S)
EXPECT = re.compile(r"exit (?P<exit>\d+)(?:; writes (?P<writes>.+))?")
# The kvreplay command the blocks run: the real command line, in a process that has
# registered drift_qwen2 (tests/tiny.py) first.
SHIM = """#!{python}
import sys
sys.path[:0] = {paths!r}
import tiny  # noqa: F401  registers drift_qwen2
from kvreplay.cli import main
main(prog_name="kvreplay")
"""


@dataclass(frozen=True)
class Block:
    code: str
    exit: int
    writes: tuple[str, ...]


def quickstart_blocks() -> list[Block]:
    blocks = []
    for match in BLOCK.finditer(PAGE.read_text(encoding="utf-8")):
        expect = EXPECT.fullmatch(match["expect"] or "exit 0")
        assert expect is not None, f"unreadable expectation {match['expect']!r} in {PAGE.name}"
        writes = tuple((expect["writes"] or "").split())
        blocks.append(Block(match["code"], int(expect["exit"]), writes))
    return blocks


def test_quickstart_blocks_declare_what_they_write() -> None:
    blocks = quickstart_blocks()
    commands = [line.split()[:2] for b in blocks for line in b.code.splitlines() if line]
    assert [c for c in commands if c[0] == "kvreplay"] == [
        ["kvreplay", "check"],
        ["kvreplay", "run"],
        ["kvreplay", "report"],
        ["kvreplay", "audit"],
    ]
    assert all(b.writes for b in blocks if b.code.startswith("kvreplay") and "audit" not in b.code)


def test_quickstart_runs_as_written(tiny_dirs, tmp_path: Path) -> None:
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    shim = bin_dir / "kvreplay"
    paths = [str(TESTS), str(Path(kvreplay.__file__).resolve().parents[1])]
    shim.write_text(SHIM.format(python=sys.executable, paths=paths), encoding="utf-8")
    shim.chmod(0o755)
    env = {
        **os.environ,
        "MODEL": str(tiny_dirs["drift_qwen2"]),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    for block in quickstart_blocks():
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == block.exit, (
            f"{block.code!r} ended with {result.returncode}, not {block.exit}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        missing = [path for path in block.writes if not (work / path).exists()]
        assert not missing, f"{block.code!r} did not write {missing}"
