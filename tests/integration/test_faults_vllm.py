"""The vLLM faults (issue 43) planted in vLLM's own classes and caught by the check option
the detection table names, on a tiny Qwen2 (head size 32) in fp32, where the clean
in-process engine holds bit for bit: hit and miss agree at every step.

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

from kvreplay.faults import planted

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32
THINK = 6  # the short plan's first stage: P is the prompt and six decoded tokens


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


@pytest.fixture(scope="module")
def aligned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Items whose P (prompt and the first stage, no chat template, one token a byte)
    spans exactly two blocks: a hit on P recomputes its last full block."""
    path = tmp_path_factory.mktemp("aligned") / "items.jsonl"
    prompts = [f"Question {i}: " + "count the stones by the river " * 2 for i in range(2)]
    prompts = [p[: 2 * BLOCK - THINK] for p in prompts]
    path.write_text("".join(json.dumps({"id": f"a{i}", "prompt": p, "answer": "1"}) + "\n"
                            for i, p in enumerate(prompts)))  # fmt: skip
    return path


def check(model: Path, out: Path, *extra: object):
    return invoke("check", "--backend", "vllm", "--model", model, "--plan", "short",
                  "--dtypes", "fp32", "--n", 2, "--out", out, *extra)  # fmt: skip


def test_the_clean_engine_holds_bit_for_bit(model: Path, aligned: Path, tmp_path: Path) -> None:
    for name, extra in (("default", ()), ("aligned", ("--items", aligned, "--no-chat"))):
        result = check(model, tmp_path / name, "--expect", "bitwise", *extra)
        assert result.exit_code == 0, result.output
        assert "HOLDS bitwise" in result.output, result.output


@pytest.mark.parametrize(
    ("fault", "expect"),
    [
        ("vllm-hit-ulp", "FAILS bitwise"),
        ("vllm-tail-position", "FAILS bitwise"),
        ("vllm-second-hit-lossy", "FAILS bitwise"),
    ],
)
def test_a_fault_on_every_hit_is_caught(
    fault: str, expect: str, model: Path, tmp_path: Path
) -> None:
    with planted(fault):
        result = check(model, tmp_path / "run", "--expect", "bitwise")
    assert result.exit_code == 1, result.output
    assert expect in result.output, result.output


def test_a_stale_block_aligned_prefix_is_caught_where_p_is_block_aligned(
    model: Path, aligned: Path, tmp_path: Path
) -> None:
    with planted("vllm-aligned-stale"):
        unaligned = check(model, tmp_path / "default", "--expect", "bitwise")
        result = check(model, tmp_path / "aligned", "--items", aligned, "--no-chat")
    assert unaligned.exit_code == 0, unaligned.output  # the default items' P are not aligned
    assert result.exit_code == 1, result.output
    assert "FAILS at token level" in result.output, result.output
