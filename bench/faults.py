"""The detection table (issues 43, 50): for each planted fault (``kvreplay.faults.FAULTS``)
and each check option (``kvreplay.faults.registry.OPTIONS``), whether kvreplay catches it,
after how many items and how many seconds (cold: a fresh process, a fresh run folder),
and each option's false-alarm rate on the same engine without a fault.

Engines and precisions are those where the clean engine is exact: on vLLM (in process, and
a ``vllm serve`` with a 16-block pool) the default check is the request-shape battery at
fp32, compared bit for bit at the reported log-probabilities; llama.cpp with a q8_0 KV
cache and flash attention; transformers at fp32. In-process faults are planted with
``python -m kvreplay.faults NAME -- check ...``; a served fault with a ``vllm serve``
started here with ``KVREPLAY_FAULT`` and the plugin folder on its path (one server per
fault, stopped after). Every result is appended to the JSON file as it comes, and a
result already there is not run again, so an interrupted measurement resumes. The tables
are :func:`kvreplay.faults.tables.detection_tables` of the file.

    python bench/faults.py detect OUT.json [--engines vllm,served] [--faults a,b]
                                           [--options default,bitwise] [--model SPEC]
    python bench/faults.py clean OUT.json --runs 20 [--engines ...] [--options ...]
    python bench/faults.py table OUT.json            # the Markdown tables
    PY / VPY: the hf and vLLM environments' Python (default .venv/bin/python,
    .venv-vllm/bin/python); the engines run this tree's src.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from helpers import vllm_server  # noqa: E402

from kvreplay.faults.plugin import write_plugin_folder  # noqa: E402
from kvreplay.faults.registry import FAULTS, OPTIONS, Fault  # noqa: E402
from kvreplay.faults.tables import COLUMNS, detection_tables  # noqa: E402

PY = os.environ.get("PY", str(REPO / ".venv" / "bin" / "python"))
VPY = os.environ.get("VPY", str(REPO / ".venv-vllm" / "bin" / "python"))
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO / "src"),
    "VLLM_LOGGING_LEVEL": "WARNING",
}
TIMEOUT = 3 * 3600


@dataclass(frozen=True)
class Engine:
    """Where a fault is planted and how a check reaches it."""

    name: str
    family: str  # the faults' engine: vllm, llamacpp, hf
    python: str
    args: tuple[str, ...]
    served: bool = False


ENGINES = {
    "vllm": Engine("vllm", "vllm", VPY, ("--backend", "vllm", "--dtypes", "fp32")),
    "served": Engine("served", "vllm", VPY, ("--backend", "http", "--dtypes", "fp32"), True),
    "llamacpp": Engine(
        "llamacpp",
        "llamacpp",
        PY,
        ("--backend", "llamacpp", "--flash-attn", "on", "--dtypes", "q8_0"),
    ),  # fmt: skip
    "hf": Engine("hf", "hf", PY, ("--dtypes", "fp32")),
}

SERVED_ONLY = ("traffic", "history")
POOL_BLOCKS = 16  # the served engine's K/V pool, as kvreplay check sizes its own
HISTORY_ITEMS = 4


def applies(option: str, engine: Engine) -> bool:
    return engine.served or option not in SERVED_ONLY


# --- one measurement ------------------------------------------------------------------


def kvreplay(engine: Engine, fault: str | None, args: list[str]) -> list[str]:
    """The command that runs ``kvreplay ARGS``, with ``fault`` planted in this process
    (an in-process engine), or as is (a server carries its own fault)."""
    if fault is None or engine.served:
        return [engine.python, "-m", "kvreplay", *args]
    return [engine.python, "-m", "kvreplay.faults", fault, "--", *args]


def measure(
    engine: Engine,
    fault: str | None,
    option: str,
    folder: Path,
    url: str | None,
    model: str,
    items: Path | None,
) -> dict:
    """One cold check (or history run): caught or not, items run, where it first failed,
    seconds, and the verdict's first line."""
    out = folder / "run"
    args = [*engine.args, "--model", model, "--out", str(out)]
    args += ["--url", url] if url else []
    args += ["--items", str(items)] if items else []
    if option == "history":
        command = ["run", "history", *args, "--n", str(HISTORY_ITEMS), "--traffic", "2"]
    else:
        command = ["check", *args, *OPTIONS[option], "--json", str(folder / "verdict.json")]
    began = time.monotonic()
    done = subprocess.run(
        kvreplay(engine, fault, command), capture_output=True, text=True, env=ENV,
        timeout=TIMEOUT,
    )  # fmt: skip
    seconds = round(time.monotonic() - began, 1)
    result = {"seconds": seconds, "exit_code": done.returncode}
    if option == "history":
        return result | history_outcome(out, done)
    verdict_file = folder / "verdict.json"
    if done.returncode not in (0, 1) or not verdict_file.is_file():
        tail = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return result | {"caught": None, "error": tail[:300]}
    verdict = json.loads(verdict_file.read_text())
    ran = [i for i in verdict["items"] if i.get("reached", True)]
    caught = done.returncode == 1
    first = next((i for i in ran if i.get("detected")), None)
    return result | {
        "caught": caught,
        "items_run": len(ran),
        "first_fail_at": len(ran) if caught else None,
        "sentence": (done.stdout.strip().splitlines() or [""])[0][:400],
        "shape": first["detected"][0] if first else None,
        "planted": verdict.get("planted_fault"),
    }


def history_outcome(out: Path, done: subprocess.CompletedProcess) -> dict:
    """A history run catches a fault when an item's hit, after any history, continues
    otherwise than its miss, or a replica gate fails."""
    rows_file = out / "rows.jsonl"
    if done.returncode != 0 or not rows_file.is_file():
        tail = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return {"caught": None, "error": tail[:300]}
    rows = [json.loads(line)["data"] for line in rows_file.read_text().splitlines()]
    rows = [r for r in rows if r.get("status") != "unreached"]
    failing = []
    for n, row in enumerate(rows, 1):
        arms = row["arms"]
        miss = arms["miss"]["suffix_sha256"]
        parted = sorted(name for name, arm in arms.items() if arm["suffix_sha256"] != miss)
        broken = sorted(name for name, gate in row["replicas"].items() if not all(gate.values()))
        if parted or broken:
            failing.append((n, parted, broken))
    first = failing[0] if failing else None
    numerics = {  # per arm: rows whose first-step logprobs are not the miss's, bit for bit
        name: sum(
            row["arms"][name]["logits_fingerprint"] != row["arms"]["miss"]["logits_fingerprint"]
            for row in rows
            if name in row["arms"]
        )
        for name in ("hit", "warm", "evicted", "traffic")
    }
    return {
        "caught": bool(failing),
        "bits_differ_from_miss": numerics,
        "items_run": len(rows),
        "first_fail_at": first[0] if first else None,
        "why": f"arms parting from the miss: {first[1]}; broken replicas: {first[2]}"
        if first
        else None,
    }


# --- servers --------------------------------------------------------------------------


@contextmanager
def vllm_serve(model_folder: str, fault: str | None, log: Path) -> Iterator[str]:
    """A ``vllm serve`` of the model in fp32 (prefix caching, block size 32, dev mode),
    with ``fault`` planted through kvreplay's vLLM plugin folder."""
    plugins = Path(tempfile.mkdtemp(prefix="kvreplay-fault-plugin-"))
    env = {
        **ENV,
        "PYTHONPATH": f"{write_plugin_folder(plugins)}{os.pathsep}{REPO / 'src'}",
        "KVREPLAY_FAULT": fault,
    }
    length = str(min((POOL_BLOCKS - 1) * 32, context(model_folder)))
    flags = ("--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--block-size", "32", "--max-model-len", length,
             "--num-gpu-blocks-override", str(POOL_BLOCKS))  # fmt: skip
    with vllm_server(model_folder, log, *flags, env=env, python=VPY, limit=1200) as url:
        yield url


def context(folder: str) -> int:
    """The model's context window, from its config."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


def model_folder(model: str) -> str:
    return subprocess.run(
        [VPY, "-c", "import sys; from kvreplay.model.sources import resolve_source; "
         "print(resolve_source(sys.argv[1])[0])", model],
        capture_output=True, text=True, check=True, env=ENV,
    ).stdout.strip()  # fmt: skip


# --- the two measurements -------------------------------------------------------------


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def record(path: Path, result: dict) -> None:
    path.write_text(json.dumps([*load(path), result], indent=2) + "\n")


def key(result: dict) -> tuple:
    return tuple(result.get(k) for k in ("kind", "fault", "engine", "option", "run", "model"))


def sweep(
    path: Path,
    kind: str,
    engines: list[Engine],
    faults: list[Fault | None],
    options: list[str],
    model: str,
    runs: int,
) -> None:
    done = {key(r) for r in load(path)}
    scratch = Path(tempfile.mkdtemp(prefix=f"kvreplay-faults-{kind}-"))
    for engine in engines:
        for fault in faults:
            if fault is not None and fault.engine != engine.family:
                continue
            name = fault.name if fault else None
            todo = [
                (option, run) for option in options if applies(option, engine)
                for run in range(runs)
                if (kind, name, engine.name, option, run, model) not in done
            ]  # fmt: skip
            if not todo:
                continue
            folder = scratch / f"{engine.name}-{name or 'clean'}"
            serving = (
                vllm_serve(model_folder(model), name, folder.with_suffix(".log"))
                if engine.served
                else nullcontext(None)
            )
            folder.mkdir(parents=True)
            with serving as url:
                for option, run in todo:
                    where = folder / f"{option}-{run}"
                    where.mkdir()
                    items = window(where, run) if kind == "clean" else None
                    result = measure(engine, name, option, where, url, model, items)
                    result |= {"kind": kind, "fault": name, "engine": engine.name,
                               "option": option, "run": run, "model": model}  # fmt: skip
                    record(path, result)
                    print(json.dumps(result), flush=True)


def window(folder: Path, run: int) -> Path:
    """The clean run's items: the built-in arith set turned by 4 items a run, so that
    each run's first items (what a 4-item check runs) are items no other run starts with."""
    from kvreplay.core.items import arith_items

    items = arith_items()
    turned = items[4 * run :] + items[: 4 * run]
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(i.to_dict(), sort_keys=True) + "\n" for i in turned))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["detect", "clean", "table"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--faults", default=",".join(f.name for f in FAULTS))
    parser.add_argument("--options", default=",".join(COLUMNS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if args.kind == "table":
        print(detection_tables(load(args.path)), end="")
        return
    engines = [ENGINES[e] for e in args.engines.split(",")]
    options = args.options.split(",")
    faults: list[Fault | None] = (
        [f for f in FAULTS if f.name in args.faults.split(",")] if args.kind == "detect" else [None]
    )
    sweep(args.path, args.kind, engines, faults, options, args.model, args.runs)


if __name__ == "__main__":
    main()
