"""Threads per process vs processes: one ``matched`` row's wall time on this machine with
1 or 2 torch threads per process, in 1 or 2 processes at once.

Each process is a fresh interpreter that loads the model (not timed), then runs the same
row (one item at one precision, ``instruct`` plan: live generation, prefill, two
replicas, four continuations) and reports its own wall time. With 2 processes both start
the row together (after both have loaded), as the demo's workers do; their throughput is
2 rows per the slower one's time. The four settings are interleaved, ``--repeat`` rounds.

Usage: .venv/bin/python bench/threads.py [--repeat 3] [--dtype bf16] [--item 0] [--plan instruct]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m"
SETTINGS = ((1, 1), (1, 2), (2, 1), (2, 2))  # (processes, threads per process)


def child(threads: int, dtype: str, item: int, plan: str, start_file: Path) -> None:
    """Load, wait for the start signal, run one row; print its seconds as JSON."""
    import torch

    from kvreplay.contract.config import RunConfig
    from kvreplay.core.items import arith_items
    from kvreplay.core.stages import get_plan
    from kvreplay.engines.worker import Worker
    from kvreplay.harness.units import Unit, UnitKey
    from kvreplay.model.reading import describe_source

    torch.set_num_threads(threads)
    config = RunConfig(MODEL, describe_source(MODEL)["model_digest"], get_plan(plan))
    worker = Worker(config)
    worker.model(dtype)
    chosen = arith_items()[item]
    unit = Unit(UnitKey("matched", chosen.id, dtype), chosen, dtype)
    print("ready", flush=True)
    while not start_file.exists():
        time.sleep(0.01)
    began = time.perf_counter()
    worker.run(unit)
    print(json.dumps({"row_s": time.perf_counter() - began}), flush=True)


def measure(processes: int, threads: int, dtype: str, item: int, plan: str) -> list[float]:
    """Start ``processes`` children, release them together once loaded; their row times."""
    start_file = Path(tempfile.mkdtemp(prefix="kvr-threads")) / "go"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    argv = [sys.executable, __file__, "--child", str(threads), "--dtype", dtype, "--plan", plan]
    children = [
        subprocess.Popen(
            [*argv, "--item", str(item), "--start-file", str(start_file)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for process in children:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    start_file.touch()
    times = []
    for process in children:
        out, _ = process.communicate()
        times.append(json.loads(out.strip().splitlines()[-1])["row_s"])
    shutil.rmtree(start_file.parent)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--item", type=int, default=0)
    parser.add_argument("--plan", default="instruct")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--start-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.dtype, args.item, args.plan, args.start_file)
        return
    walls: dict[tuple[int, int], list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeat):
        for processes, threads in SETTINGS:
            times = measure(processes, threads, args.dtype, args.item, args.plan)
            walls[processes, threads].append(max(times))
    print(
        f"one matched row ({MODEL}, {args.dtype}, {args.plan} plan, arith item {args.item}); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"median (min-max) of {args.repeat}"
    )
    print(f"{'processes':>9} {'threads each':>12} {'row wall s':>18} {'rows/min':>9}")
    for (processes, threads), values in walls.items():
        median = statistics.median(values)
        spread = f"{median:.1f} ({min(values):.1f}-{max(values):.1f})"
        print(f"{processes:>9} {threads:>12} {spread:>18} {60 * processes / median:>9.2f}")


if __name__ == "__main__":
    main()
