"""The default check on vLLM in process is the request-shape battery (issue 50), held to
every vLLM fault of the suite: on a tiny Qwen2 (head size 32) in fp32, where the clean
engine's hit and miss agree bit for bit in every shape, the clean engine passes, its run
re-executes under audit and its verdict is valid JSON of the check's schema, and each
fault, planted in vLLM's own classes, fails the check
its declaration names (``Fault.caught_by``) at the first item, so a change that loses a
detection fails here.

The faults are planted with :func:`kvreplay.faults.planted` in this process, where the
in-process engine core runs its scheduler and model runner; the module shares one engine
between its checks (a fault patches vLLM's classes, so it reaches a running engine), which
keeps it to one engine start. Runs in the vLLM environment (``-m vllm``). In this process
(click's runner) vLLM's logger writes to the runner's output, so the verdict is looked for
in it rather than at its start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import invoke
from tiny import save_tiny

from kvreplay.experiments.battery.shapes import SHAPES
from kvreplay.faults import FAULTS, planted
from kvreplay.faults.registry import OPTIONS

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

# A weight-update fault is held to its check (check --update) by
# test_weight_update_vllm.py, whose engine may take an update: this module shares one.
VLLM_FAULTS = [f for f in FAULTS if f.engine == "vllm" and f.caught_by != "update"]
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("vllm-faults") / "model", "served_qwen2")


@pytest.fixture(scope="module", autouse=True)
def one_engine() -> Iterator[None]:
    """Every check of the module reuses the engine the first one started."""
    from kvreplay.backends import vllm as backend

    started: dict[tuple, Any] = {}
    start = backend.start_engine

    def shared(folder: str, precision: str, settings: Any, *args: Any) -> Any:
        key = (folder, precision, settings, *args)
        if key not in started:
            started[key] = start(folder, precision, settings, *args)
        return started[key]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(backend, "start_engine", shared)
        yield


def check(model: Path, folder: Path, *extra: object):
    return invoke("check", "--backend", "vllm", "--model", model, "--out", folder / "run",
                  "--json", folder / "verdict.json", *extra)  # fmt: skip


def test_the_clean_engine_passes_every_shape_and_its_run_reexecutes(
    model: Path, tmp_path: Path
) -> None:
    import jsonschema

    result = check(model, tmp_path)
    assert result.exit_code == 0, result.output
    assert "HOLDS at the measured level" in result.output, result.output
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    jsonschema.validate(verdict, json.loads((DOCS / "check-v4.schema.json").read_text()))
    assert verdict["compared"] == ["cache-hit", "cache-miss"]
    assert verdict["planted_fault"] is None
    assert verdict["shapes"]["ran"] == list(SHAPES)  # every shape exercised, none skipped
    assert verdict["shapes"]["levels"]["tokens"] == ["twin", "concurrent"]
    assert verdict["environment"]["backend"]["kv_blocks"] == 16
    audit = invoke("audit", tmp_path / "run")
    assert audit.exit_code == 0, audit.output
    assert "rows in ledger: 1; re-executed: 1" in audit.output


@pytest.mark.parametrize("fault", VLLM_FAULTS, ids=[f.name for f in VLLM_FAULTS])
def test_the_check_its_declaration_names_catches_each_vllm_fault(
    fault: Any, model: Path, tmp_path: Path
) -> None:
    with planted(fault.name):
        result = check(model, tmp_path, "--n", 2, *OPTIONS[fault.caught_by])
    assert result.exit_code == 1, result.output
    assert f"with the fault {fault.name} planted" in result.output, result.output
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["planted_fault"] == fault.name
    assert verdict["stopped_early"] and len(verdict["items"]) == 1  # the first item caught it
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["planted_fault"] == fault.name
