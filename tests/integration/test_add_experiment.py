"""The "Add an experiment" page (docs/experiments/add.md) is built and run: every code
block of its package is written to a folder, installed by its entry point (a dist-info
folder on the path, as an installed package has), and run through the CLI on a tiny
model; the files the run writes are checked, so the tutorial cannot drift from the code."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "experiments" / "add.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)


def blocks() -> list[tuple[str, str]]:
    """The page's fenced blocks, as (language, text)."""
    return BLOCK.findall(PAGE.read_text(encoding="utf-8"))


def install(root: Path) -> None:
    """Write the page's package under ``root`` and its entry point beside it."""
    for language, text in blocks():
        first = text.splitlines()[0]
        if language == "python" and first.startswith("# repeat_experiment/"):
            path = root / first.removeprefix("# ")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    (toml,) = [text for language, text in blocks() if language == "toml"]
    group, line = toml.strip().splitlines()
    info = root / "repeat_experiment-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repeat-experiment\nVersion: 1.0\n")
    section = group.removeprefix('[project.entry-points."').removesuffix('"]')
    entry = line.replace('"', "")
    (info / "entry_points.txt").write_text(f"[{section}]\n{entry}\n")


def kvreplay(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvreplay", *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])},
    )  # fmt: skip


def test_the_tutorial_experiment_is_one_package_and_one_registry_line(tmp_path: Path) -> None:
    install(tmp_path / "site")
    files = sorted(p.relative_to(tmp_path / "site").as_posix() for p in tmp_path.rglob("*.py"))
    assert files == [
        "repeat_experiment/__init__.py",
        "repeat_experiment/experiment.py",
        "repeat_experiment/options.py",
        "repeat_experiment/table.py",
    ]
    entry = (tmp_path / "site/repeat_experiment-1.0.dist-info/entry_points.txt").read_text()
    assert entry == "[kvreplay.experiments]\nrepeat = repeat_experiment:DECLARATION\n"


def test_the_tutorial_experiment_runs_through_the_cli(tmp_path: Path, tiny_dirs) -> None:
    site = tmp_path / "site"
    install(site)
    listed = kvreplay(site, "run", "--help")
    assert listed.returncode == 0 and "repeat" in listed.stdout, listed.stderr
    shown = kvreplay(site, "run", "repeat", "--help")
    assert "--construction [prefill|replay]" in shown.stdout
    assert "[default: prefill]" in shown.stdout

    refused = kvreplay(site, "run", "repeat", "--model", str(tiny_dirs["qwen2"]),
                       "--construction", "live", "--out", str(tmp_path / "bad"))  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert not (tmp_path / "bad").exists()

    out = tmp_path / "run"
    done = kvreplay(site, "run", "repeat", "--model", str(tiny_dirs["qwen2"]), "--n", "2",
                    "--dtypes", "fp32", "--construction", "replay", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"manifest.json", "rows.jsonl", "repeat_twice.csv"} <= {p.name for p in out.iterdir()}
    with (out / "repeat_twice.csv").open(newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert [(line["precision"], line["row_id"]) for line in lines] == sorted(
        (line["precision"], line["row_id"]) for line in lines
    )
    assert len(lines) == 2
    assert all(line["boundary_argmax_equal"] == "true" for line in lines)
    assert all(line["suffix_equal"] == "true" for line in lines)

    audited = kvreplay(site, "audit", str(out), "--sample", "1")
    assert audited.returncode == 0, audited.stdout + audited.stderr
