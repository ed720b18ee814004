"""The stale-cache gate (issue 51): ``kvreplay check --update`` run cold (a fresh process,
a fresh run folder) on a clean engine ``--clean`` times, and with the fault that skips
the prefix-cache reset after a weight reload (``vllm-update-stale-cache``) ``--faulty``
times: each run's exit code, verdict and seconds, appended to a JSON file as it comes (a
run already there is not run again, so an interrupted measurement resumes). The faulty
runs come first, so that a measurement cut short by ``--budget`` (seconds after which no
further run starts) still has both kinds.

    flock /tmp/kvreplay-heavy.lock python bench/update_gate.py OUT.json --clean 20 \\
        --faulty 2 [--model smollm2-135m] [--engine vllm|served] [--update perturb:0.001] \\
        [--budget SECONDS]

``vllm``: vLLM in the check's own process (the fault planted with ``python -m
kvreplay.faults``), so every run is cold; ``served``: ``kvreplay check --backend http``
against a ``vllm serve`` started here, in dev mode (the fault through kvreplay's vLLM
plugin): one server for the clean runs and one for the faulty ones, each check a fresh
process and run folder, so a sync's leftovers from one run would reach the next.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from kvreplay.faults.plugin import write_plugin_folder
from kvreplay.faults.registry import ENV as FAULT_ENV
from kvreplay.model.embedded import EMBEDDED, convert_embedded

REPO = Path(__file__).resolve().parents[1]
VPY = os.environ.get("VPY", str(REPO / ".venv-vllm" / "bin" / "python"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
FAULT = "vllm-update-stale-cache"
# Unset, ``vllm serve`` runs its model runner in a worker process of its own, apart from
# the scheduler; the fault's record of a reload stays in the worker, so its reset is never
# skipped. Set to 0 (as the test suite's servers inherit it), the runner lives beside the
# scheduler. Recorded with each run.
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def model_folder(model: str) -> str:
    """What ``vllm serve`` loads: the embedded model's converted folder, or ``model``."""
    return str(convert_embedded(EMBEDDED[model])) if model in EMBEDDED else model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(model: str, fault: bool, log: Path) -> Iterator[str]:
    """A ``vllm serve`` of ``model`` in bf16 (dev mode, prefix caching, cached-token
    counts, 32-token blocks as the in-process engine), the fault planted where asked;
    its URL once it answers."""
    plugin = write_plugin_folder(log.parent / "plugin")
    env = {**ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": f"{plugin}{os.pathsep}{ENV['PYTHONPATH']}",
           **({FAULT_ENV: FAULT} if fault else {})}  # fmt: skip
    port = free_port()
    command = [VPY, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--block-size", "32", "--max-model-len", "2048"]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                if process.poll() is not None:
                    sys.exit(f"vllm serve exited with {process.returncode}; see {log}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    time.sleep(2)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=120)


def run(model: str, update: str, n: int, fault: bool, folder: Path, url: str | None) -> dict:
    """One check in a fresh process; its exit code, verdict and seconds."""
    planted = fault and url is None
    head = ["-m", "kvreplay.faults", FAULT, "--"] if planted else ["-m", "kvreplay"]
    backend = ["--backend", "vllm"] if url is None else ["--backend", "http", "--url", url]
    args = ["check", *backend, "--model", model, "--dtypes", "bf16", "--n", str(n),
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
    parser.add_argument("--engine", choices=("vllm", "served"), default="vllm")
    parser.add_argument("--budget", type=float, default=float("inf"))
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.is_file() else []
    stop = time.monotonic() + args.budget
    plan = [True] * args.faulty + [False] * args.clean
    model = model_folder(args.model) if args.engine == "served" else args.model
    with tempfile.TemporaryDirectory() as logs:
        for fault in (True, False):
            todo = [i for i, f in enumerate(plan) if f == fault and i >= len(results)]
            if not todo or time.monotonic() > stop:
                continue
            log = Path(logs) / ("faulty" if fault else "clean") / "vllm.log"
            log.parent.mkdir()
            started = serve(model, fault, log) if args.engine == "served" else nullcontext()
            with started as url:
                for index in todo:
                    if time.monotonic() > stop:
                        break
                    with tempfile.TemporaryDirectory() as folder:
                        result = run(model, args.update, args.n, fault, Path(folder), url)
                    load = [round(x, 2) for x in os.getloadavg()]
                    head = {"run": index, "engine": args.engine, "model": args.model,
                            MULTIPROCESSING: os.environ.get(MULTIPROCESSING)}  # fmt: skip
                    results.append({**head, "update": args.update, **result, "load_average": load})
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
