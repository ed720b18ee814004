"""Plans, prompts and small helpers shared by the tests: the core engine's, the command
line's and the ledger readers'."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from kvreplay import (
    BoundaryState,
    LoadedModel,
    Prefix,
    StagePlan,
    build,
    clone,
    continue_from,
    encode_prompt,
    live,
)
from kvreplay.cli import main
from kvreplay.core.stages import Stage
from kvreplay.experiments.matrix.table import FIXED_PREFIX_TABLE, LAYER_DRIFT, MATCHED_TABLE
from kvreplay.experiments.registry import table_for

ARCHS = ("qwen2", "llama", "gemma3")
DTYPES = ("bf16", "fp32")

# Long enough on the tiny models for bf16 prefill to drift from live (24 decoded tokens
# in the prefix) and for that drift to flip a suffix token on some prompt of each arch.
PLAN = StagePlan(
    name="test",
    stages=(
        Stage("think", max_new_tokens=24),
        Stage("trace", max_new_tokens=48),
        Stage("answer", max_new_tokens=4, opener="\nA:"),
    ),
)
# A short plan for tests that only need some boundary state.
SHORT = StagePlan(
    name="test-short",
    stages=(
        Stage("think", max_new_tokens=10),
        Stage("trace", max_new_tokens=8),
        Stage("answer", max_new_tokens=3, opener="\nA:"),
    ),
)
DEFAULT_THREADS = torch.get_num_threads()  # read at collection, before conftest sets 1
INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
PROMPTS = (
    "Compute 3 + 4 * 5 step by step.",
    "A shop has 17 apples. It sells 5 apples. How many are left?",
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 3,
)


_WORDS = "apple river seven blue window market quiet stone number garden".split()
# Prompts of 12 to 44 tokens: on drift_qwen2 (tests/tiny.py) the short ones stay exact
# and most long ones diverge, on every kernel family.
PROMPT_POOL = tuple(
    f"Item {i}: " + " ".join(_WORDS[(i * 7 + j * 3) % 10] for j in range(i % 6)) + "?"
    for i in range(16)
)


@dataclass(frozen=True)
class Divergence:
    """Prompts of a bounded pool on which prefill's suffix differs from replay's (with
    equal boundary argmaxes, as a transplant panel needs) and does not differ."""

    divergent: tuple[str, ...]
    exact: tuple[str, ...]


def find_divergence(
    lm: LoadedModel, plan: StagePlan, want: int = 1, pool: tuple[str, ...] = PROMPT_POOL
) -> Divergence:
    """Search ``pool`` in order; fail with a clear message if it holds too few cases."""
    divergent: list[str] = []
    exact: list[str] = []
    for prompt in pool:
        _, prefix = reach(lm, plan, prompt)
        replay, prefill = build(lm, prefix, "replay"), build(lm, prefix, "prefill")
        differs = (
            continue_from(lm, clone(replay), plan).token_ids
            != continue_from(lm, clone(prefill), plan).token_ids
        )
        if differs and replay.argmax() == prefill.argmax():
            divergent.append(prompt)
        elif not differs:
            exact.append(prompt)
        if len(divergent) >= want and exact:
            return Divergence(tuple(divergent), tuple(exact))
    pytest.fail(
        f"{lm.spec}: {len(divergent)} divergent and {len(exact)} exact prompts in the "
        f"{len(pool)}-prompt pool under {torch.backends.cpu.get_cpu_capability()} kernels; "
        f"the test needs {want} and 1"
    )


def perturbed(state: BoundaryState, seed: int = 0) -> BoundaryState:
    """A copy of ``state`` whose K/V differ from it by seeded noise (logits kept): a donor
    that differs by construction, whatever the CPU's rounding."""
    copy = clone(state)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():  # the cache holds inference tensors
        for layer in copy.cache.layers:
            for tensor in (layer.keys, layer.values):
                noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
                tensor.add_(noise * 0.1)
    copy.construction = "perturbed"
    return copy


def cli_commands(
    group: click.Group = main, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command of the command line, by its words (``("run", "matched")``)."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from cli_commands(command, (*path, name))
        else:
            yield (*path, name), command


def cli_params(command: click.Command) -> list[click.Parameter]:
    """A command's parameters, those made when it is first parsed included."""
    return command.get_params(click.Context(command))


def invoke(*args: object) -> Result:
    """``kvreplay ARGS`` through click's runner, in this process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def reach(
    lm: LoadedModel, plan: StagePlan = SHORT, prompt: str = PROMPTS[0]
) -> tuple[BoundaryState, Prefix]:
    """The live boundary state and prefix of ``prompt`` under ``plan``."""
    return live(lm, encode_prompt(lm.tokenizer, prompt), plan)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (so -0.0 != 0.0 and NaN == NaN bitwise)."""
    return tensor.detach().contiguous().view(INT_OF_SIZE[tensor.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def cache_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Every K and V tensor bit-equal and every layer's length equal."""
    return a.layer_lengths() == b.layer_lengths() and all(
        bit_equal(x, y)
        for pa, pb in zip(a.layer_tensors(), b.layer_tensors(), strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def state_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Same prefix, bit-equal cache and bit-equal boundary logits."""
    assert a.logits is not None and b.logits is not None
    return a.token_ids == b.token_ids and cache_equal(a, b) and bit_equal(a.logits, b.logits)


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the session runs (conftest); said explicitly where it
    matters, e.g. a Ray actor reserves one of the machine's CPUs per driver thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def default_threads() -> Iterator[None]:
    """Run with torch's default intra-op thread count, as a user's run would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_items(path: Path, prompts: Sequence[str], prefix: str, answer: str) -> Path:
    """An item file: one item per prompt, ids ``{prefix}{index}``, the same answer."""
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{i}", "prompt": p, "answer": answer}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def pool_inputs(root: Path) -> tuple[Path, Path]:
    """The prompt pool as items, and the tests' stage plan as a plan file, in ``root``."""
    items = write_items(root / "items.jsonl", PROMPT_POOL, "p", "1")
    plan = root / "plan.json"
    plan.write_text(json.dumps(PLAN.to_dict()))
    return items, plan


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError("the server did not come up")


@contextmanager
def vllm_server(
    model: Path | str,
    log: Path,
    *flags: str,
    env: dict[str, str | None] | None = None,
    python: str = sys.executable,
    limit: float = 900,
) -> Iterator[str]:
    """A real ``vllm serve`` (vLLM's OpenAI server module) of ``model`` on a free loopback
    port, in dev mode with a small CPU KV space and one thread, its output in ``log``;
    yields its URL once it answers and stops it on leaving. ``env`` overrides this
    process's environment (None removes a name)."""
    port = free_port()
    merged = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            env={k: v for k, v in merged.items() if v is not None},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, process, limit)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


# The core install (no torch), built by `make setup-core`; .ci/run names it in
# KVREPLAY_CORE_VENV, and a test that needs it then fails rather than skips without it.
CORE_VENV = Path(
    os.environ.get("KVREPLAY_CORE_VENV") or Path(__file__).resolve().parents[1] / ".venv-core"
)


def core(*args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``kvreplay ARGS`` run in the core environment, with this test's environment."""
    program = CORE_VENV / "bin" / "kvreplay"
    if not program.is_file():
        missing = f"the core environment {CORE_VENV} is not built; run `make setup-core`"
        if os.environ.get("KVREPLAY_CORE_VENV"):
            pytest.fail(missing)
        pytest.skip(missing)
    return subprocess.run(
        [str(program), *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def same_suffixes(left: Path, right: Path) -> None:
    """Two runs' rows hold the same prefixes and every arm the same suffix tokens."""

    def arms(run: Path) -> list[tuple]:
        found = []
        for line in (run / "rows.jsonl").read_text().splitlines():
            data = json.loads(line)["data"]
            found.append((data["item_id"], data.get("prefix_token_ids")))
            for name, arm in sorted(data.get("arms", {}).items()):
                found.append((name, arm.get("suffix_token_ids")))
        return found

    assert arms(left) == arms(right)


Rows = list[dict[str, str]]


def token_hash(tokens: list[int]) -> str:
    """A suffix commitment as the paper makes it: SHA-256 of canonical JSON."""
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def required_columns(file_name: str) -> dict[str, str]:
    """The columns analysis requires of a ledger file (row_id aside), with their kinds."""
    table = table_for(Path(file_name))
    assert table is not None, f"{file_name} is no known ledger"
    return {c.name: c.kind for c in table.columns if c.use == "required" and c.name != "row_id"}


def synthetic_ledger(file_name: str) -> tuple[list[str], Rows]:
    """A small valid ledger from its table: every flag true, one divergent row."""
    columns = required_columns(file_name)
    defaults = {
        "text": "x",
        "bool": "true",
        "sha256": token_hash([1, 2, 3]),
        "int": "7",
        "optional_int": "",
        "float": "0.5",
    }
    precisions = ("bf16", "fp32") if "precision" in columns else ("",)
    rows = []
    for precision in precisions:
        for i in range(3):
            row = {column: defaults[kind] for column, kind in columns.items()}
            row |= {"row_id": f"r{i:04d}", "precision": precision} if precision else {}
            row.setdefault("row_id", f"r{i:04d}")
            rows.append(row)
    other = token_hash([9])
    if "prefill_replica_suffix_sha256" in columns:  # a matrix file
        rows[0] |= {
            "prefill_suffix_sha256": other,
            "prefill_replica_suffix_sha256": other,
            "suffix_equal": "false",
            "first_suffix_divergence_index": "2",
        }
    if "baseline_divergent" in columns:
        for row in rows:
            row["exact_control_novel_trajectory"] = "false"
        rows[0] |= {
            "prefill_native_suffix_sha256": other,
            "prefill_cache_into_incremental_suffix_sha256": other,
        }
        rows[1:] = [row | {"baseline_divergent": "false"} for row in rows[1:]]
    return ["row_id", *columns], rows


def write_ledger(folder: Path, file_name: str, header: list[str], rows: Rows) -> Path:
    with (folder / file_name).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return folder / file_name


LAYERS = 6
ITEMS = 24


def _matrix_rows(file_name: str, left: str, rng: np.random.Generator) -> list[dict[str, str]]:
    """Two precisions over ITEMS items; bf16 diverges often, fp32 never; per-layer drift added."""
    columns = required_columns(file_name)
    rows = []
    for precision, drift_scale, divergence_rate in (("bf16", 1e-2, 0.7), ("fp32", 1e-6, 0.0)):
        for item in range(ITEMS):
            diverges = rng.random() < divergence_rate
            left_suffix, prefill_suffix = [item, 1, 2], [item, 1, 2] if not diverges else [item, 9]
            left_correct = rng.random() < 0.5
            prefill_correct = (
                left_correct if not diverges or rng.random() < 0.8 else not left_correct
            )
            drift = drift_scale * rng.uniform(0.5, 2.0, LAYERS) * np.geomspace(1, 10, LAYERS)
            if precision == "fp32":
                drift[0] = 0.0  # an exact layer, which the log axis cannot draw
            values = {
                "bool": "true",
                "sha256": token_hash([item]),
                "int": str(100 + item),
                "optional_int": "",
                "float": f"{drift.mean():.6g}",
                "text": precision,
            }
            row = {"row_id": f"r{item:04d}"} | {c: values[k] for c, k in columns.items()}
            row |= {
                f"{left}_suffix_sha256": token_hash(left_suffix),
                f"{left}_replica_suffix_sha256": token_hash(left_suffix),
                "prefill_suffix_sha256": token_hash(prefill_suffix),
                "prefill_replica_suffix_sha256": token_hash(prefill_suffix),
                "first_suffix_divergence_index": str(rng.integers(1, 200)) if diverges else "",
                **dict.fromkeys(
                    ("suffix_equal", "trace_equal", "merge_equal"), str(not diverges).lower()
                ),
                "answer_equal": str(left_correct == prefill_correct).lower(),
                f"{left}_correct": str(left_correct).lower(),
                "prefill_correct": str(prefill_correct).lower(),
                f"{left}_prefill_cache_exact": "false",
                f"{left}_prefill_logits_exact": "false",
                LAYER_DRIFT: json.dumps(drift.tolist()),
            }
            rows.append(row)
    return rows


def _transplant_rows() -> list[dict[str, str]]:
    columns = required_columns("kv_transplant_demo.csv")
    rows = []
    for item in range(6):
        divergent = item < 4
        incremental, prefill = token_hash([item]), token_hash([item, 7] if divergent else [item])
        values = {"bool": "true", "sha256": incremental, "int": "5", "text": "demo"}
        row = {"row_id": f"r{item:04d}"} | {c: values[k] for c, k in columns.items()}
        row |= {
            "prefill_native_suffix_sha256": prefill,
            "prefill_cache_into_incremental_suffix_sha256": prefill,
            "baseline_divergent": str(divergent).lower(),
            "exact_control_novel_trajectory": "false",
        }
        rows.append(row)
    return rows


def synthetic_run(folder: Path) -> Path:
    """A run directory like kvreplay writes (``folder``/run): manifest, matrix ledgers
    with per-layer drift over ITEMS items, and a transplant panel."""
    run = folder / "run"
    run.mkdir()
    rng = np.random.default_rng(3)
    for table, left in ((MATCHED_TABLE, "live"), (FIXED_PREFIX_TABLE, "incremental")):
        rows = _matrix_rows(table.file, left, rng)
        write_ledger(run, table.file, list(rows[0]), rows)
    rows = _transplant_rows()
    write_ledger(run, "kv_transplant_demo.csv", list(rows[0]), rows)
    manifest = {
        "format": "kvreplay-run-v1",
        "kvreplay_version": "0.1.0",
        "git_commit": None,
        "contract": {
            "model_info": {
                "spec": "tiny-test-model",
                "model_type": "qwen2",
                "num_layers": 3,
                "model_digest": token_hash([1]),
            },
            "environment": {
                "device": "cpu",
                "device_name": "x86_64",
                "threads": 2,
                "torch": "2.13.0",
                "transformers": "5.24.0",
                "python": "3.11.7",
                "dtype_contract": {"deterministic_algorithms": False},
            },
            "run": {"plan": {"name": "short", "boundary_stage": "think"}},
            "items": {"source": "arith", "count": 240, "digest": "0" * 64},
        },
        "experiments": {"matched": {"engine": {"engine": "local"}}},
    }
    (run / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return run


# Refusals (issues 2, 3, 11): a run on good items that some flag or file breaks.
GOOD = [
    {"id": "b1", "prompt": "What is 2+3?", "answer": "5"},
    {"id": "b2", "prompt": "Compute 4*5.", "answer": "20"},
    {"id": "b3", "prompt": [{"role": "user", "content": "9-4?"}], "answer": 5},
]
QUICK = ["--n", "1", "--dtypes", "fp32"]


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_lines() -> list[str]:
    return [json.dumps(item) for item in GOOD]


def items_with(tmp: Path, line: str) -> list[str]:
    """``--items`` of the good items and one more line."""
    return ["--items", str(jsonl(tmp / "bad.jsonl", [*good_lines(), line]))]


def run_args(
    experiment: str, tmp: Path, model: Path, extra: Sequence[object] = ()
) -> tuple[list[str], Path]:
    """``kvreplay run EXPERIMENT`` on the good items with the short plan into tmp/out, each
    flag of ``extra`` (flag, value pairs) in place of the base's; and its --out folder."""
    base = {
        "--model": str(model),
        "--items": str(jsonl(tmp / "good.jsonl", good_lines())),
        "--plan": "short",
        "--out": str(tmp / "out"),
    }
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[str(flag)] = str(value)
    flat = [part for pair in base.items() for part in pair]
    return ["run", experiment, *flat], Path(base["--out"])


def assert_nothing_complete(out: Path) -> None:
    """No derived CSV and no rows: nothing that looks like (part of) a result."""
    if not out.exists():
        return
    assert not list(out.glob("*.csv")), list(out.iterdir())
    assert not (out / "rows.jsonl").exists()


def assert_one_sentence(stderr: str, expected: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kvreplay: error: "), stderr
    assert expected in lines[0], (expected, lines[0])
    assert "Traceback" not in stderr


def check(result: Result, expected: str, out: Path) -> None:
    """A refusal: exit 2, one sentence, no traceback, nothing in ``out`` that looks done."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # not an uncaught exception
    assert_one_sentence(result.stderr, expected)
    assert "Traceback" not in result.output
    assert_nothing_complete(out)


def run_case(case: Callable[[Path], tuple[list[str], str]], tmp: Path, model: Path) -> None:
    """A matched run with the case's arguments added is refused before the manifest."""
    extra, expected = case(tmp)
    args, out = run_args("matched", tmp, model)
    check(invoke(*args, *extra), expected, out)
    assert not (out / "manifest.json").exists()


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
