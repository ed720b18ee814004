"""How far a committed run's numerics move on this machine's CPU family, measured the way
an audit on another platform meets them (audit/crossing.py): sampled rows re-executed
here, and for every greedy trajectory (those after one that parted in the same arm, or
after a prefix that parted, are another continuation and left out) the largest move of a
top-1/top-2 margin before it parts from the recorded one, and both margins where it
parts. The near-tie bounds in
``kvreplay.audit.crossing.NEAR_TIE`` are chosen from these numbers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cross_platform.py results/smollm2-n24 --sample 4
    (a vLLM run from .venv-vllm); writes bench/results/cross_platform/<run>.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from kvreplay.audit.contract import check_contract, load_audited_items
from kvreplay.audit.crossing import parted, trajectories, within
from kvreplay.audit.reexecute import Reexecution, comparable
from kvreplay.contract.config import RunConfig
from kvreplay.contract.environment import environment
from kvreplay.engines import Placement
from kvreplay.engines.threads import intra_op_threads
from kvreplay.ledger import RunLedger, RunRows, diff_fields
from kvreplay.model.reading import load_tokenizer

OUT = Path(__file__).resolve().parent / "results" / "cross_platform"


class Measured(Reexecution):
    """A re-execution that records margins instead of judging."""

    found: list[dict[str, Any]]

    def compare(self, key: str, record: Any, recorded: dict, fresh: dict) -> list[str]:
        ours, theirs = comparable(recorded), comparable(fresh)
        other = {t.path: t for t in trajectories(theirs)}
        apart: list[str] = []  # owners already parted: what follows is another continuation
        for mine in sorted(trajectories(ours), key=lambda t: t.owner.count(".") + bool(t.owner)):
            here = other.get(mine.path)
            if here is None or any(within(mine.owner, a) for a in apart):
                continue
            step = parted(mine, here)
            if step is not None:
                apart.append(mine.owner)
            common = len(mine.margins) if step is None else step
            moves = [abs(float(a) - float(b)) for a, b in
                     zip(mine.margins[:common], here.margins[:common], strict=False)]  # fmt: skip
            self.found.append(
                {
                    "row": key,
                    "path": mine.path,
                    "precision": recorded.get("precision"),
                    "steps": len(mine.token_ids),
                    "largest_move_before": max(moves, default=0.0),
                    "parts_at": step,
                    "margins_there": None if step is None else [
                        mine.margins[step] if step < len(mine.margins) else None,
                        here.margins[step] if step < len(here.margins) else None,
                    ],
                }
            )  # fmt: skip
        return [] if not diff_fields(ours, theirs) else ["differs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--sample", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ledger = RunLedger.open_existing(args.run)
    config = RunConfig.from_contract(ledger.manifest["contract"]["run"], str(args.run), {})
    items, _ = load_audited_items(ledger)
    rows, _ = RunRows.checked(ledger.rows_path, ledger.contract_hash)
    _, platform = check_contract(ledger, config, items, load_tokenizer(config.model))
    keys = random.Random(args.seed).sample(rows.keys(), min(args.sample, len(rows.keys())))
    replay = Measured(config, Placement(), rows.by_key(), {i.id: i for i in items or []})
    replay.found = []
    started = time.monotonic()
    with intra_op_threads(1):
        replay.run(keys)
    here = environment(config.device)
    recorded = ledger.manifest["contract"]["environment"]
    result = {
        "run": args.run.name,
        "recorded": {k: recorded.get(k) for k in ("cpu_capability", "platform", "cpu_features")},
        "here": {k: here.get(k) for k in ("cpu_capability", "cpu_vendor", "cpu_features")},
        "platform": platform.describe(),
        "rows": keys,
        "seconds": round(time.monotonic() - started, 1),
        "trajectories": replay.found,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.run.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    parts = [t for t in replay.found if t["parts_at"] is not None]
    moves = sorted(t["largest_move_before"] for t in replay.found)
    print(f"{args.run.name}: {len(replay.found)} trajectories, {len(parts)} part; largest "
          f"margin move before parting {moves[-1] if moves else 0:g}; margins where they part: "
          f"{[t['margins_there'] for t in parts]}")  # fmt: skip


if __name__ == "__main__":
    main()
