"""Backend refusals (issue 13) that need no engine: one sentence, exit 2, nothing written.
They hold in either environment; the one about a missing vLLM only where it is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import invoke


def refused(tmp_path: Path, *args: object) -> str:
    out = tmp_path / "run"
    result = invoke("run", *args, "--out", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    return result.output


@pytest.mark.parametrize("experiment", ["transplant", "localize", "bridge", "fixed-prefix"])
def test_kv_experiments_refused_on_vllm(tmp_path: Path, tiny_dirs, experiment: str) -> None:
    output = refused(tmp_path, experiment, "--model", tiny_dirs["qwen2"], "--backend", "vllm")
    assert "K/V tensors, which the vllm backend does not expose" in output
    assert "--backend hf" in output


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--block-size", 48, "multiple of 32"),
        ("--max-num-seqs", 0, "--max-num-seqs must be from 1 to 1024"),
        ("--max-num-seqs", 5000, "--max-num-seqs must be from 1 to 1024"),
        ("--companions", 8, "--companions must be from 0 to 7"),
    ],
)
def test_bad_engine_settings(tmp_path: Path, tiny_dirs, option: str, value: int, message: str):
    output = refused(
        tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend", "vllm", option, value
    )
    assert message in output


def test_a_setting_of_another_backend_is_refused(tmp_path: Path, tiny_dirs) -> None:
    output = refused(tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--block-size", 64)
    assert "--block-size does not apply to the hf backend" in output


def test_backends_lists_each_backend_with_its_capabilities() -> None:
    from helpers import invoke

    result = invoke("backends")
    assert result.exit_code == 0, result.output
    assert "hf (installed)" in result.output and "kv_access" in result.output
    assert "vllm (" in result.output and "cached_token_report" in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_not_installed(tmp_path: Path, tiny_dirs) -> None:
    output = refused(tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend", "vllm")
    assert "make setup-vllm" in output
