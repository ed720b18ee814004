"""Fixtures the integration tests share: one small matched run with snapshots, built once
per session, and a fresh copy of it per test (each test tampers with its own); and a
synthetic run folder of ledgers for the report's tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import invoke, synthetic_run, write_items

PROMPTS = ["What is 2+3?", "Compute 4*5."]
CSV = "matched_live_prefill.csv"


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]) -> Path:
    """matched on 2 items x bf16, fp32 (4 rows) with snapshots."""
    root = tmp_path_factory.mktemp("audit-base")
    items = write_items(root / "items.jsonl", PROMPTS, "t", "5")
    out = root / "run"
    result = invoke(
        "run", "matched", "--model", tiny_dirs["qwen2"], "--items", items, "--plan", "short",
        "--dtypes", "bf16,fp32", "--save-snapshots", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    return out


@pytest.fixture
def run(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(built, copy)
    return copy


@pytest.fixture(name="synthetic_run")
def synthetic_run_fixture(tmp_path: Path) -> Path:
    return synthetic_run(tmp_path)
