"""What the Ray engine costs on this machine: start-up, and per item vs the local engine.

The same ``matched`` units (``short`` plan, both precisions) run on the local engine and
on Ray with 1 and 2 workers. Each engine runs the units twice: the cold pass includes
every worker's model loads, the warm pass is the steady state. Per-item overhead is
measured two ways: the warm wall time per item minus the local engine's, and the wall
time the driver waited per item minus the time the worker itself reported (the cost of
dispatch, transfer and result collection alone).

Usage: .venv/bin/python bench/ray_overhead.py [--model tiny|smollm2-135m|PATH] [--n 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvreplay.contract.config import RunConfig
from kvreplay.core.items import load_items
from kvreplay.core.stages import get_plan
from kvreplay.engines.local import LocalEngine
from kvreplay.engines.placement import Placement
from kvreplay.engines.ray import RayEngine
from kvreplay.experiments.matched.experiment import Matched
from kvreplay.harness.scope import Scope
from kvreplay.harness.units import Unit
from kvreplay.model.reading import describe_source

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    engine: str
    workers: int
    start_s: float
    cold_s: float
    warm_s: float
    worker_s: float  # model + harness time the workers reported in the warm pass


def model_spec(name: str) -> str:
    """``tiny`` writes the tests' tiny qwen2 folder; ``smollm2-135m`` uses the test cache."""
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import save_tiny

        return str(save_tiny(Path(tempfile.mkdtemp(prefix="kvr-bench")) / "qwen2", "qwen2"))
    if name == "smollm2-135m" and "KVREPLAY_CACHE" not in os.environ:
        os.environ["KVREPLAY_CACHE"] = str(REPO / ".cache" / "kvreplay-test")
    return name


def timed_pass(engine: Any, units: list[Unit]) -> tuple[float, float]:
    """Wall seconds to get every row, and the seconds the workers reported for them."""
    began = time.perf_counter()
    reported = sum(t["model_s"] + t["harness_s"] for _, _, t, _ in engine.run(units))
    return time.perf_counter() - began, reported


def measure(name: str, workers: int, make: Any, units: list[Unit]) -> Result:
    began = time.perf_counter()
    engine = make()
    start = time.perf_counter() - began
    try:
        cold, _ = timed_pass(engine, units)
        warm, reported = timed_pass(engine, units)
    finally:
        engine.close()
    return Result(name, workers, start, cold, warm, reported)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--n", type=int, default=4, help="items (units = 2 x n)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    spec = model_spec(args.model)
    config = RunConfig(spec, describe_source(spec)["model_digest"], get_plan("short"))
    scope = Scope(config, load_items("arith"), ("bf16", "fp32"), args.n)
    matched = Matched()
    units = matched.units(0, scope, matched.select(scope, {}), {})

    import ray

    began = time.perf_counter()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False)
    ray_init = time.perf_counter() - began
    results = [measure("local", 1, lambda: LocalEngine(config), units)]
    for workers in (1, 2):
        results.append(
            measure(
                "ray",
                workers,
                lambda w=workers: RayEngine(config, Placement("ray", workers=w)),
                units,
            )
        )
    ray.shutdown()

    local_item = results[0].warm_s / len(units)
    print(f"\nmodel {args.model}, {len(units)} units (matched, short plan, bf16+fp32), "
          f"torch threads {args.threads}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"ray.init (local, no dashboard): {ray_init:.2f} s")
    header = ("engine", "workers", "start s", "cold pass s", "warm pass s", "warm s/item",
              "vs local ms/item", "dispatch ms/item", "speed-up")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        per_item = r.warm_s / len(units)
        # Driver wait minus worker time is pure dispatch only while one worker is busy.
        dispatch = f"{(r.warm_s - r.worker_s) / len(units) * 1000:.1f}" if r.workers == 1 else "-"
        cells = (r.engine, r.workers, f"{r.start_s:.2f}", f"{r.cold_s:.2f}", f"{r.warm_s:.2f}",
                 f"{per_item:.3f}", f"{(per_item - local_item) * 1000:+.0f}", dispatch,
                 f"{local_item / per_item:.2f}x")  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
