"""The stale-cache gate (issue 51): ``kvreplay check --update`` run cold (a fresh process,
a fresh run folder) on a clean engine ``--clean`` times, and with the fault that skips
the prefix-cache reset after a weight reload (``vllm-update-stale-cache``) ``--faulty``
times: each run's exit code, verdict and seconds, appended to a JSON file as it comes (a
run already there is not run again, so an interrupted measurement resumes).

    flock /tmp/kvreplay-heavy.lock python bench/update_gate.py OUT.json --clean 20 \\
        --faulty 2 [--model smollm2-135m] [--engine vllm|served] [--update perturb:0.001]

``vllm``: vLLM in this process (the fault planted with ``python -m kvreplay.faults``);
``served``: a ``vllm serve`` started here (the fault through kvreplay's vLLM plugin).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VPY = os.environ.get("VPY", str(REPO / ".venv-vllm" / "bin" / "python"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
FAULT = "vllm-update-stale-cache"


def run(model: str, update: str, n: int, fault: bool, folder: Path) -> dict:
    """One cold check; its exit code, verdict and seconds."""
    head = ["-m", "kvreplay.faults", FAULT, "--"] if fault else ["-m", "kvreplay"]
    args = ["check", "--backend", "vllm", "--model", model, "--dtypes", "bf16", "--n", str(n),
            "--update", update, "--out", str(folder / "check"),
            "--json", str(folder / "verdict.json")]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run([VPY, *head, *args], env=ENV, capture_output=True, text=True)
    seconds = time.monotonic() - start
    verdict = folder / "verdict.json"
    found = json.loads(verdict.read_text()) if verdict.is_file() else None
    return {
        "fault": fault,
        "exit": done.returncode,
        "seconds": round(seconds, 1),
        "stale": None if found is None else found["stale"],
        "items": None if found is None else found["items"],
        "sentence": (found or {}).get("sentence") or done.stderr.strip().splitlines()[-1:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--clean", type=int, default=20)
    parser.add_argument("--faulty", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--update", default="perturb:0.001")
    parser.add_argument("--n", type=int, default=2)
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.is_file() else []
    plan = [False] * args.clean + [True] * args.faulty
    for index, fault in enumerate(plan):
        if index < len(results):
            continue
        with tempfile.TemporaryDirectory() as folder:
            result = run(args.model, args.update, args.n, fault, Path(folder))
        results.append({"run": index, "model": args.model, "update": args.update, **result})
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results[-1]), flush=True)
    clean = [r for r in results if not r["fault"]]
    faulty = [r for r in results if r["fault"]]
    print(f"clean: {sum(r['exit'] == 0 for r in clean)} of {len(clean)} held "
          f"(false alarms {sum(r['exit'] == 1 for r in clean)}, errors "
          f"{sum(r['exit'] not in (0, 1) for r in clean)}); faulty: "
          f"{sum(r['exit'] == 1 for r in faulty)} of {len(faulty)} caught")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
