"""``--workers N`` on the local engine and ``--threads``: rows run in spawned worker
processes give the same ledger and byte-identical CSVs as a serial run; the thread count
is kvreplay's choice, recorded in the contract, and a resume or audit on another count is
refused with the flag that restores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SHORT, invoke

from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.demo import run_demo
from kvreplay.engines import processes
from kvreplay.harness.units import Unit, UnitKey

PROMPTS = [
    ("w1", "What is 2+3?", "5"),
    ("w2", "Tom has 3 apples and gets 4 more. How many?", "7"),
    ("w3", "Compute 4*5.", "20"),
]
CSVS = ("matched_live_prefill.csv", "fixed_prefix_2x2.csv")


def _items(folder: Path) -> Path:
    path = folder / "items.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": p, "answer": a}) + "\n" for i, p, a in PROMPTS)
    )
    return path


def _run(model: Path, items: Path, out: Path, experiment: str, *extra: object) -> None:
    result = invoke(
        "run", experiment, "--model", model, "--items", items, "--plan", "short",
        "--dtypes", "bf16,fp32", "--out", out, *extra,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output[-3000:], result.exception)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines()]


def _manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]) -> dict[str, Path]:
    """matched then fixed-prefix (two phases), serially and on 2 workers; on the tiny qwen2
    (a spawned worker cannot load drift_qwen2, which only this process registers)."""
    root = tmp_path_factory.mktemp("local-workers")
    items = _items(root)
    out = {"serial": root / "serial", "parallel": root / "parallel"}
    for experiment in ("matched", "fixed-prefix"):
        _run(tiny_dirs["qwen2"], items, out["serial"], experiment)
        _run(tiny_dirs["qwen2"], items, out["parallel"], experiment, "--workers", 2)
    return out


def test_parallel_workers_equal_a_serial_run(runs: dict[str, Path]) -> None:
    serial, parallel = _rows(runs["serial"]), _rows(runs["parallel"])
    assert [r["key"] for r in parallel] == [r["key"] for r in serial]
    assert len(serial) == 3 * 2 + 3 + 3 * 2  # matched, prefix rows, fixed-prefix
    for a, b in zip(serial, parallel, strict=True):
        assert a["data"] == b["data"], a["key"]  # fingerprints, suffixes, labels
    assert {r["worker"] for r in serial} == {"local"}
    assert {r["worker"] for r in parallel} == {"local-0", "local-1"}  # both did work
    for name in CSVS:
        assert (runs["parallel"] / name).read_bytes() == (runs["serial"] / name).read_bytes()


def test_worker_count_is_a_note_not_the_contract(runs: dict[str, Path]) -> None:
    serial, parallel = _manifest(runs["serial"]), _manifest(runs["parallel"])
    assert parallel["contract"] == serial["contract"]
    assert parallel["contract"]["environment"]["threads"] == 1
    for name in ("matched", "fixed-prefix"):
        engine = parallel["experiments"][name]["engine"]
        assert engine["engine"] == "local" and engine["worker_count"] == 2
        assert [w["worker"] for w in engine["workers"]] == ["local-0", "local-1"]
        assert all(w["threads"] == 1 for w in engine["workers"])
        assert serial["experiments"][name]["engine"]["worker_count"] == 1


def test_demo_on_two_workers_equals_a_serial_demo(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All three experiments on one pair of worker processes, started once."""
    started: list[processes.ProcessEngine] = []
    engine_class = processes.ProcessEngine

    def counted(*args: Any) -> processes.ProcessEngine:
        started.append(engine_class(*args))
        return started[-1]

    monkeypatch.setattr(processes, "ProcessEngine", counted)
    model = str(tiny_dirs["qwen2"])
    run_demo(tmp_path / "serial", n=1, model=model, workers=1)
    run_demo(tmp_path / "parallel", n=1, model=model, workers=2)
    assert len(started) == 1
    serial, parallel = _rows(tmp_path / "serial"), _rows(tmp_path / "parallel")
    assert [r["data"] for r in parallel] == [r["data"] for r in serial]
    for name in (*CSVS, "live_teacher_bridge.csv"):
        assert (tmp_path / "parallel" / name).read_bytes() == (
            tmp_path / "serial" / name
        ).read_bytes()


def test_a_worker_refusal_ends_the_run_in_its_one_sentence(tiny_dirs: dict[str, Path]) -> None:
    """A unit's KvreplayError in a worker process reaches the driver as itself."""
    config = RunConfig(str(tiny_dirs["qwen2"]), "0" * 64, SHORT)  # not the files' digest
    item = Item(id="w1", prompt=PROMPTS[0][1], answer="5")
    units = [Unit(UnitKey("matched", "w1", d), item, d) for d in ("bf16", "fp32")]
    engine = processes.ProcessEngine(config, 2)
    try:
        with pytest.raises(KvreplayError, match="digest differs from the run's"):
            list(engine.run(units))
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.processes)


def test_threads_are_recorded_and_a_resume_or_audit_on_another_count_is_refused(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    items, out = _items(tmp_path), tmp_path / "run"
    before = torch.get_num_threads()
    result = invoke(
        "run", "matched", "--model", tiny_dirs["qwen2"], "--items", items, "--plan", "short",
        "--dtypes", "fp32", "--n", 1, "--threads", 2, "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output[-3000:], result.exception)
    assert torch.get_num_threads() == before  # the caller's count is restored
    assert _manifest(out)["contract"]["environment"]["threads"] == 2
    resumed = invoke(
        "run", "matched", "--model", tiny_dirs["qwen2"], "--items", items, "--plan", "short",
        "--dtypes", "fp32", "--n", 1, "--out", out,
    )  # fmt: skip
    assert resumed.exit_code == 2
    assert "recorded 2 threads" in resumed.stderr and "pass --threads 2" in resumed.stderr
    audited = invoke("audit", out, "--sample", 0)
    assert audited.exit_code == 2
    assert "pass --threads 2 to audit it" in audited.stderr
    assert invoke("audit", out, "--sample", 0, "--threads", 2).exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ("run", "matched", "--threads", 0),
        ("run", "matched", "--workers", 0),
        ("demo", "--threads", 0),
        ("demo", "--workers", 0),
        ("audit", "nowhere", "--threads", 0),
    ],
)
def test_zero_threads_or_workers_refused_in_one_sentence(args: tuple, tmp_path: Path) -> None:
    result = invoke(*args, "--out", tmp_path / "x") if args[0] != "audit" else invoke(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvreplay: error:"), result.stderr
    assert ("--threads" if "--threads" in args else "--workers") in lines[0]


def _children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(child) for child in text.split()}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's reaping is left


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_workers_die_with_a_driver_killed_outright(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """SIGKILL gives the driver no chance to stop its workers; a busy one must not run on
    to the end of its unit (units here take seconds), so the kernel kills it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    plan = tmp_path / "long.json"
    plan.write_text(json.dumps({"name": "long", "boundary": 0, "stages": [
        {"name": "think", "max_new_tokens": 200},
        {"name": "trace", "max_new_tokens": 700},
        {"name": "answer", "max_new_tokens": 4},
    ]}))  # fmt: skip
    out = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", "from kvreplay.cli import main; main()", "run", "matched",
         "--model", str(tiny_dirs["qwen2"]), "--items", str(_items(tmp_path)),
         "--plan", str(plan), "--dtypes", "fp32", "--workers", "2", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not ((out / "rows.jsonl").is_file() and (out / "rows.jsonl").stat().st_size):
            assert supervisor.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        (driver,) = _children(supervisor.pid)  # the command runs in a watched child
        workers = _children(driver)
        assert len(workers) >= 2
    finally:
        os.kill(driver, signal.SIGKILL)
        _, stderr = supervisor.communicate(timeout=60)
    time.sleep(2.0)
    assert not [pid for pid in workers if _alive(pid)]
    assert supervisor.returncode == 2 and b"died with SIGKILL (signal 9" in stderr
