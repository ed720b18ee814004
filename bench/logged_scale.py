"""Logged rollouts at RL scale (issue 51): write kvreplay's JSONL of synthetic rollouts
(float32 log-probabilities, as engines and trainers report them: the rollout side drawn,
the trainer's a small perturbation of it, a mask that keeps each response token but a
padded tail), then time ``kvreplay mismatch`` on it and record its peak memory.

    python bench/logged_scale.py write long.jsonl --rollouts 1 --tokens 32768
    python bench/logged_scale.py write big.jsonl --bytes 1e9 --tokens 512
    flock /tmp/kvreplay-heavy.lock /usr/bin/time -v kvreplay mismatch big.jsonl

The numbers go to docs/findings/rollout.md and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("write")
    out.add_argument("path", type=Path)
    out.add_argument("--rollouts", type=int)
    out.add_argument("--bytes", type=float)
    out.add_argument("--tokens", type=int, default=512)
    out.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    write(args.path, args.rollouts, args.bytes, args.tokens, args.steps)


if __name__ == "__main__":
    main()
