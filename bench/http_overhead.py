"""Per-row wall time of ``matched`` over HTTP (a running ``vllm serve``) vs the in-process
vllm backend, on the same model, items, plan and engine settings (issue 26), and where
the difference goes.

Usage (in .venv-vllm, which has both backends):
  python bench/http_overhead.py --backend vllm [--n 6]
  python bench/http_overhead.py --backend http --url URL [--n 6]

Runs ``kvreplay run matched`` in this process into a scratch folder (no companions) and
prints one JSON line: rows, the median per-row model seconds the ledger recorded (the
arms' requests; the engine start is outside every row) and, over HTTP, the requests a
row makes, the seconds spent inside them and the median round trip of a request the
server answers without the model (``GET /health``): the transport and API layer alone.
``bench/http_overhead.sh`` starts a server with the in-process backend's settings and
pairs the two with farm-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("vllm", "http"), required=True)
    parser.add_argument("--url", default="")
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()

    from kvreplay.backends.http import server
    from kvreplay.cli import main as cli

    calls: list[tuple[str, float]] = []
    original = server.Client._exchange  # every request goes through it

    def timed(self: server.Client, method: str, path: str, body: object, limit: int) -> object:
        began = time.perf_counter()
        try:
            return original(self, method, path, body, limit)
        finally:
            calls.append((path.split("?")[0], time.perf_counter() - began))

    server.Client._exchange = timed  # type: ignore[method-assign]
    out = Path(tempfile.mkdtemp(prefix="http-overhead-")) / "run"
    argv = ["run", "matched", "--backend", args.backend, "--n", str(args.n),
            "--dtypes", args.dtype, "--companions", "0", "--out", str(out)]  # fmt: skip
    if args.url:
        argv += ["--url", args.url]
    began = time.perf_counter()
    cli.main(argv, standalone_mode=False)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    model = [row["timing"]["model_s"] for row in rows]
    result = {
        "backend": args.backend,
        "rows": len(rows),
        "wall_s": round(wall, 2),
        "row_model_s_median": round(statistics.median(model), 3),
        "rows_model_s_total": round(sum(model), 2),
    }
    if args.backend == "http":
        in_rows = [(p, s) for p, s in calls if p in ("/v1/completions", "/reset_prefix_cache")]
        client = server.Client(args.url, 60.0, None)
        health = []
        for _ in range(20):
            began = time.perf_counter()
            client.call("GET", "/health")
            health.append(time.perf_counter() - began)
        result |= {
            "requests_per_row": round(len(in_rows) / len(rows), 1),
            "completions_per_row": round(
                sum(p == "/v1/completions" for p, _ in in_rows) / len(rows), 1
            ),
            "seconds_in_requests_per_row": round(sum(s for _, s in in_rows) / len(rows), 3),
            "other_calls": len(calls) - len(in_rows),
            "health_round_trip_ms_median": round(statistics.median(health) * 1000, 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
