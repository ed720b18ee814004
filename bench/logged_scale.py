"""Logged rollouts at RL scale (issue 51): write kvreplay's JSONL of synthetic rollouts
(float32 log-probabilities, as engines and trainers report them: the rollout side drawn,
the trainer's a small perturbation of it, a mask that keeps each response token but a
padded tail), then time ``kvreplay mismatch`` on it and record its peak memory.

    python bench/logged_scale.py write long.jsonl --rollouts 1 --tokens 32768
    python bench/logged_scale.py write big.jsonl --bytes 1e9 --tokens 512
    flock /tmp/kvreplay-heavy.lock python bench/logged_scale.py time big.jsonl \\
        bench/results/logged_scale.json

``time`` runs ``kvreplay mismatch`` under ``/usr/bin/time -v`` and appends its seconds
(wall and CPU), tokens a second, peak resident memory and the load average to a JSON
file. The numbers
go to docs/findings/rollout.md and docs/benchmarks/runs.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np


def line(rng: np.random.Generator, index: int, tokens: int, steps: int) -> str:
    """One rollout: a 32-token prompt, ``tokens`` response tokens, the last tenth padded
    (pad id 0, log-probability 0.0 on both sides, mask 0) as verl pads a batch."""
    rollout = (-rng.exponential(0.8, tokens)).astype(np.float32)
    trainer = np.minimum(rollout + rng.normal(0, 0.03, tokens).astype(np.float32), 0)
    kept = tokens - tokens // 10
    rollout[kept:], trainer[kept:] = 0.0, 0.0
    ids = rng.integers(1, 49152, tokens)
    ids[kept:] = 0
    mask = [1] * kept + [0] * (tokens - kept)
    record = {
        "id": f"r{index}",
        "prompt_ids": rng.integers(1, 49152, 32).tolist(),
        "response_ids": ids.tolist(),
        "rollout_logprobs": rollout.astype(np.float64).tolist(),
        "trainer_logprobs": trainer.astype(np.float32).astype(np.float64).tolist(),
        "mask": mask,
        "step": index % steps,
    }
    return json.dumps(record, separators=(",", ":")) + "\n"


def write(path: Path, rollouts: int | None, size: float | None, tokens: int, steps: int) -> None:
    rng = np.random.default_rng(51)
    written = count = 0
    with path.open("w") as handle:
        while (rollouts is not None and count < rollouts) or (size is not None and written < size):
            text = line(rng, count, tokens, steps)
            handle.write(text)
            written += len(text)
            count += 1
    print(f"wrote {path}: {count} rollouts of {tokens} tokens, {written / 1e6:.1f} MB")


def measure(path: Path, out: Path, kvreplay: str) -> None:
    """Time ``kvreplay mismatch`` on ``path`` (its rollouts and response tokens counted
    here, outside the timing) and append the record to ``out``."""
    rollouts = tokens = kept = 0
    with path.open() as handle:
        for text in handle:
            record = json.loads(text)
            rollouts += 1
            tokens += len(record["response_ids"])
            kept += sum(record["mask"])
    load = os.getloadavg()
    done = subprocess.run(["/usr/bin/time", "-v", kvreplay, "mismatch", str(path)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    seconds = _clock(re.search(r"Elapsed \(wall clock\) time.*: (\S+)", done.stderr)[1])
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)[1])
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): (\S+)", done.stderr)[1])
              for kind in ("User", "System"))  # fmt: skip
    record = {
        "file": path.name,
        "file_mb": round(path.stat().st_size / 1e6, 1),
        "rollouts": rollouts,
        "response_tokens": tokens,
        "masked_in_tokens": kept,
        "seconds": seconds,
        "tokens_per_second": round(tokens / seconds),
        "cpu_seconds": round(cpu, 2),
        "tokens_per_cpu_second": round(tokens / cpu),
        "peak_mb": round(peak / 1024, 1),
        "load_average_before": [round(x, 2) for x in load],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "command": f"kvreplay mismatch {path.name}",
    }
    found = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([*found, record], indent=2) + "\n")
    print(json.dumps(record))


def _clock(text: str) -> float:
    """Seconds from /usr/bin/time's ``[h:]m:ss.cc``."""
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + float(part)
    return round(seconds, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("write")
    out.add_argument("path", type=Path)
    out.add_argument("--rollouts", type=int)
    out.add_argument("--bytes", type=float)
    out.add_argument("--tokens", type=int, default=512)
    out.add_argument("--steps", type=int, default=8)
    timed = sub.add_parser("time")
    timed.add_argument("path", type=Path)
    timed.add_argument("out", type=Path)
    timed.add_argument("--kvreplay", default=str(Path(sys.executable).with_name("kvreplay")))
    args = parser.parse_args()
    if args.command == "write":
        write(args.path, args.rollouts, args.bytes, args.tokens, args.steps)
    else:
        measure(args.path, args.out, args.kvreplay)


if __name__ == "__main__":
    main()
