"""How long a cached ``load_model`` takes in a fresh interpreter, and where the time goes.

Each probe is a new Python process that imports torch and transformers' Llama stack
(what any load pays), then calls ``kvreplay.load_model`` from the converted cache, and
reports both parts; the probes of every ``--src`` checkout are interleaved, so a
before/after comparison shares the machine's state. Goal: the whole probe <= 3 s.

Usage:
    .venv/bin/python bench/load_time.py [--repeat 5] [--dtype bf16]
        [--src src --src /tmp/kvreplay-before/src]   # e.g. a `git worktree` of an older commit

The model is converted into the cache first if it is not there yet (not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.models.llama.modeling_llama
t1 = time.perf_counter()
import kvreplay
kvreplay.load_model(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}))
"""


def probe(src: Path, dtype: str, cache: Path | None = None) -> dict[str, float]:
    """One fresh interpreter importing kvreplay from ``src`` (and converting into ``cache``,
    when given, if it is empty); seconds of each part."""
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if cache is not None:
        env["KVREPLAY_CACHE"] = str(cache)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, MODEL, dtype],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--src", action="append", type=Path, help="a kvreplay src folder")
    args = parser.parse_args()
    sources = [s.resolve() for s in args.src or [REPO / "src"]]
    for src in sources:
        probe(src, args.dtype)  # converts once if needed; warms the page cache
    results: dict[Path, list[dict[str, float]]] = {src: [] for src in sources}
    for _ in range(args.repeat):
        for src in sources:
            results[src].append(probe(src, args.dtype))
    print(
        f"cached load_model({MODEL!r}, {args.dtype!r}) in a fresh interpreter, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"median (min-max) of {args.repeat}"
    )
    for src, runs in results.items():
        parts = []
        for key in ("imports_s", "load_s", "total_s"):
            values = [r[key] for r in runs]
            spread = f"{min(values):.2f}-{max(values):.2f}"
            parts.append(f"{key[:-2]} {statistics.median(values):.2f} s ({spread})")
        print(f"  {src}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
