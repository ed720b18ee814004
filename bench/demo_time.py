"""Wall time of ``kvreplay demo`` (what ``make demo`` runs after set-up) with a warm
set-up: the venv exists and the embedded model is already converted.

Each run is a fresh process into a fresh output folder; runs of every ``--src`` checkout
are interleaved so a before/after comparison shares the machine's state. Goal: <= 3 min.

Usage:
    .venv/bin/python bench/demo_time.py [--repeat 3] [--src src --src /tmp/before/src]
        [-- --workers 2 --threads 1]   # extra demo options (the current checkout only)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = "from kvreplay.cli import main; main()"


def demo(src: Path, extra: list[str]) -> float:
    """One ``kvreplay demo`` from ``src`` in a fresh process; its wall seconds."""
    folder = Path(tempfile.mkdtemp(prefix="kvr-demo"))
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1")
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", DEMO, "demo", "--out", str(folder / "demo"), *extra],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - began
    shutil.rmtree(folder)
    if done.returncode != 0:
        sys.exit(f"kvreplay demo from {src} failed:\n{done.stderr[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--src", action="append", type=Path, help="a kvreplay src folder")
    parser.add_argument("extra", nargs="*", help="options passed to the current src's demo")
    args = parser.parse_args()
    current = (REPO / "src").resolve()
    sources = [s.resolve() for s in args.src or [current]]
    env = dict(os.environ, PYTHONPATH=str(sources[0]), HF_HUB_OFFLINE="1")
    warm = "import kvreplay; kvreplay.load_model('smollm2-135m', 'bf16')"
    subprocess.run([sys.executable, "-c", warm], env=env, check=True)  # converts once
    walls: dict[Path, list[float]] = {src: [] for src in sources}
    for _ in range(args.repeat):
        for src in sources:
            walls[src].append(demo(src, args.extra if src == current else []))
    print(
        f"kvreplay demo, warm set-up; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; median (min-max) of {args.repeat}"
    )
    for src, values in walls.items():
        median = statistics.median(values)
        print(f"  {src}: {median:.0f} s ({min(values):.0f}-{max(values):.0f})")


if __name__ == "__main__":
    main()
