"""Seconds per row for each experiment and precision of a run, split into model time
(forward passes) and harness time (comparison, hashing, copying, I/O), from the timing
every row of rows.jsonl records. Usage: python bench/ledger_timing.py RUN_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(run_dir: Path) -> None:
    groups: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for line in (run_dir / "rows.jsonl").read_text().splitlines():
        row = json.loads(line)
        kind = row["data"].get("kind", "row")
        groups[(f"{row['experiment']}:{kind}", row["data"]["precision"])].append(row["timing"])
    print(
        f"{'experiment':<22} {'dtype':<5} {'rows':>4} {'median s/row':>12} "
        f"{'model s':>8} {'harness s':>9} {'harness/model':>13}"
    )
    for (name, dtype), timings in sorted(groups.items()):
        model = statistics.median(t["model_s"] for t in timings)
        harness = statistics.median(t["harness_s"] for t in timings)
        total = statistics.median(t["model_s"] + t["harness_s"] for t in timings)
        model_total = sum(t["model_s"] for t in timings)
        ratio = sum(t["harness_s"] for t in timings) / model_total if model_total else None
        shown = "-" if ratio is None else f"{ratio:.1%}"
        print(
            f"{name:<22} {dtype:<5} {len(timings):>4} {total:>12.2f} {model:>8.2f} "
            f"{harness:>9.3f} {shown:>13}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
