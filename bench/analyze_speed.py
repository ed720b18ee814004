"""Time `kvreplay analyze` on the paper's full release (goal: under 5 s).

Usage: .venv/bin/python bench/analyze_speed.py [LEDGER_DIR] [--repeat N]

The default folder is ../shared/paper-release/data beside the repository; the
timing covers reading and validating every ledger, all nine bootstraps of
20,000 replicates, and writing claims.json. One cold run in a fresh interpreter
(package import included, as `kvreplay analyze` pays it) is timed as well.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvreplay.analysis.claims import analyze_dir, write_claims

PAPER_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "paper-release" / "data"
GOAL_SECONDS = 5.0
COLD_RUN = (
    "import sys; from pathlib import Path;"
    " from kvreplay.analysis.claims import analyze_dir, write_claims;"
    " write_claims(analyze_dir(Path(sys.argv[1])), Path(sys.argv[2]))"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger_dir", nargs="?", type=Path, default=PAPER_DATA)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not args.ledger_dir.is_dir():
        print(f"no ledgers at {args.ledger_dir}; pass a folder of CSV ledgers", file=sys.stderr)
        return 2
    times = []
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeat):
            start = time.perf_counter()
            write_claims(analyze_dir(args.ledger_dir), Path(scratch) / "claims.json")
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        output = str(Path(scratch) / "cold.json")
        subprocess.run([sys.executable, "-c", COLD_RUN, str(args.ledger_dir), output], check=True)
        cold = time.perf_counter() - start
    rows = sum(
        len(path.read_text(encoding="utf-8").splitlines()) - 1
        for path in args.ledger_dir.glob("*.csv")
    )
    median = statistics.median(times)
    print(
        f"analyze {args.ledger_dir} ({rows} rows): median {median:.3f} s,"
        f" min {min(times):.3f} s over {args.repeat} runs; cold process {cold:.2f} s"
        f" (goal < {GOAL_SECONDS:.0f} s)"
    )
    return 0 if median < GOAL_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
