"""The Ray engine changes no result: the same run on two Ray actors yields the same rows,
fingerprints and CSV as the local engine, survives an actor dying mid-run, and audits.

One local Ray serves the whole test session (starting one costs seconds on a small box).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import one_thread

pytest.importorskip("ray")

from kvreplay.audit.audit import audit  # noqa: E402
from kvreplay.audit.request import AuditRequest  # noqa: E402
from kvreplay.cli import main  # noqa: E402
from kvreplay.contract.config import RunConfig  # noqa: E402
from kvreplay.core.errors import KvreplayError  # noqa: E402
from kvreplay.engines import Placement  # noqa: E402
from kvreplay.engines import ray as ray_engine  # noqa: E402
from kvreplay.run.request import RunRequest  # noqa: E402
from kvreplay.run.runner import run  # noqa: E402

pytestmark = pytest.mark.ray
# A sockets path under Ray's temp dir must stay within the 107-byte AF_UNIX limit.
MAX_RAY_TEMP_LEN = 40
UNIT_KEYS = [f"matched/r{i:04d}/{d}" for d in ("bf16", "fp32") for i in range(3)]


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One local Ray for the session: 2 CPUs, no dashboard, no usage stats, no auth."""
    root = tmp_path_factory.mktemp("ray")
    if len(str(root)) > MAX_RAY_TEMP_LEN:
        root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        import ray

        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=str(root),
            configure_logging=False,
            log_to_driver=False,
        )
        try:
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(root, ignore_errors=True)


def _request(model: Path, out: Path, **engine: Any) -> RunRequest:
    return RunRequest(
        experiment="matched", out=out, model=str(model), n=3, plan="short",
        dtypes=("bf16", "fp32"), placement=Placement(**engine),
    )  # fmt: skip


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(
    local_ray: None, tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same matched run with the local engine and with two Ray workers."""
    root = tmp_path_factory.mktemp("ray-runs")
    with one_thread():
        run(_request(tiny_dirs["qwen2"], root / "local"), quiet=True)
        run(_request(tiny_dirs["qwen2"], root / "ray", engine="ray", workers=2), quiet=True)
    return {"local": root / "local", "ray": root / "ray"}


def test_ray_run_equals_local_run(runs: dict[str, Path]) -> None:
    local, distributed = _rows(runs["local"]), _rows(runs["ray"])
    assert [r["key"] for r in local] == [r["key"] for r in distributed] == UNIT_KEYS
    for a, b in zip(local, distributed, strict=True):
        assert a["data"] == b["data"], a["key"]  # every fingerprint, hash, suffix and label
    assert {r["worker"] for r in distributed} <= {"ray-0", "ray-1"}
    csv_name = "matched_live_prefill.csv"  # no timing or worker in it: byte-identical
    assert (runs["local"] / csv_name).read_bytes() == (runs["ray"] / csv_name).read_bytes()
    engine = json.loads((runs["ray"] / "manifest.json").read_text())["experiments"]["matched"][
        "engine"
    ]
    assert engine["engine"] == "ray" and engine["worker_count"] == 2
    assert [w["worker"] for w in engine["workers"]] == ["ray-0", "ray-1"]
    assert all(w["device"] == "cpu" and w["threads"] == 1 for w in engine["workers"])


def test_ray_run_survives_a_dead_worker(
    local_ray: None,
    tiny_dirs: dict[str, Path],
    runs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Actor ray-0 exits abruptly on its first unit; that unit is handed out again. (The
    first: every actor is handed one at the start, while a later unit may never reach
    ray-0 on a loaded box, where ray-1 can take all the rest.)"""
    engines: list[ray_engine.RayEngine] = []
    engine_class = ray_engine.RayEngine

    def crashing(*args: Any) -> ray_engine.RayEngine:
        engines.append(engine_class(*args, fault_injection={"ray-0": 1}))
        return engines[-1]

    monkeypatch.setattr(ray_engine, "RayEngine", crashing)
    out = tmp_path / "crash"
    with one_thread():
        run(_request(tiny_dirs["qwen2"], out, engine="ray", workers=2), quiet=True)
    assert engines[0].retries == 1
    rows = _rows(out)
    assert [r["key"] for r in rows] == UNIT_KEYS  # each row once, in order
    for a, b in zip(_rows(runs["local"]), rows, strict=True):
        assert a["data"] == b["data"], a["key"]
    # Re-execution is the data comparison above; the audit adds the chain, duplicates, CSV.
    result = audit(out, AuditRequest(sample=0))
    assert result.passed, result.problems


def test_audit_on_ray(runs: dict[str, Path]) -> None:
    with one_thread():
        result = CliRunner().invoke(
            main, ["audit", str(runs["ray"]), "--engine", "ray", "--workers", "2"]
        )
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    assert f"re-executed: {len(UNIT_KEYS)}" in result.output


def test_ray_engine_refuses_gpus_on_a_cpu_device(runs: dict[str, Path]) -> None:
    manifest = json.loads((runs["ray"] / "manifest.json").read_text())
    config = RunConfig.from_contract(manifest["contract"]["run"])
    with pytest.raises(KvreplayError, match="gpus-per-worker"):
        ray_engine.RayEngine(config, Placement("ray", workers=2, gpus_per_worker=1.0))
