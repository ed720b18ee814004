"""`kvreplay report` on the paper's ledgers and on a synthetic kvreplay run directory."""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvreplay.analysis.cli_commands import report
from kvreplay.analysis.ledgers import (
    FIXED_FILE,
    LAYER_DRIFT_COLUMN,
    MATCHED_FILE,
    LedgerError,
    spec_for,
)
from kvreplay.report import build_report

PAPER_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release" / "data"
LAYERS = 6
ITEMS = 24


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def _write(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _matrix_rows(file_name: str, left: str, rng: np.random.Generator) -> list[dict[str, str]]:
    """Two precisions over ITEMS items; bf16 diverges often, fp32 never; per-layer drift added."""
    spec = spec_for(file_name)
    assert spec is not None
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
            row = {"row_id": f"r{item:04d}"} | {c: values[k] for c, k in spec.columns.items()}
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
                LAYER_DRIFT_COLUMN: json.dumps(drift.tolist()),
            }
            rows.append(row)
    return rows


def _transplant_rows() -> list[dict[str, str]]:
    spec = spec_for("kv_transplant_demo.csv")
    assert spec is not None
    rows = []
    for item in range(6):
        divergent = item < 4
        incremental, prefill = token_hash([item]), token_hash([item, 7] if divergent else [item])
        values = {"bool": "true", "sha256": incremental, "int": "5", "text": "demo"}
        row = {"row_id": f"r{item:04d}"} | {c: values[k] for c, k in spec.columns.items()}
        row |= {
            "prefill_native_suffix_sha256": prefill,
            "prefill_cache_into_incremental_suffix_sha256": prefill,
            "baseline_divergent": str(divergent).lower(),
            "exact_control_novel_trajectory": "false",
        }
        rows.append(row)
    return rows


@pytest.fixture
def synthetic_run(tmp_path: Path) -> Path:
    """A run directory like kvreplay writes: manifest, ledgers with per-layer drift."""
    run = tmp_path / "run"
    run.mkdir()
    rng = np.random.default_rng(3)
    _write(run / MATCHED_FILE, _matrix_rows(MATCHED_FILE, "live", rng))
    _write(run / FIXED_FILE, _matrix_rows(FIXED_FILE, "incremental", rng))
    _write(run / "kv_transplant_demo.csv", _transplant_rows())
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


def embedded_images(page: str) -> list[str]:
    return re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)


def assert_self_contained(page: str) -> None:
    assert "<script" not in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    assert "@import" not in page and "url(" not in page


def test_report_on_paper_data(tmp_path: Path) -> None:
    if not PAPER_DATA.is_dir():
        pytest.skip(f"the paper's ledgers are not at {PAPER_DATA} (clone with shared/ beside it)")
    paths = build_report(PAPER_DATA, tmp_path)
    markdown = paths.markdown.read_text(encoding="utf-8")
    page = paths.html.read_text(encoding="utf-8")
    assert "| matched_live_prefill bf16: suffix differs | 166/200 | 166/200 |" in markdown
    assert "| transplant primary: donor recovered both ways | 24/24 | 24/24 |" in markdown
    assert "+1.0 pp [-3.5, +5.5]" in markdown
    assert "per-layer cache drift figure is skipped" in markdown
    assert "No manifest.json" in markdown
    assert {p.name for p in paths.figures} == {
        "disagreement_rates.png",
        "accuracy.png",
        "first_divergence.png",
        "transplant_recovery.png",
    }
    assert len(embedded_images(page)) == len(paths.figures)
    assert_self_contained(page)
    assert (
        json.loads((tmp_path / "claims.json").read_text())["schema"]
        == "stage-replay-paper-claims-v1"
    )


def test_report_on_synthetic_run(synthetic_run: Path) -> None:
    paths = build_report(synthetic_run)
    assert paths.html == synthetic_run / "report.html"
    assert (synthetic_run / "claims.json").is_file()
    markdown = paths.markdown.read_text(encoding="utf-8")
    assert "| model | tiny-test-model (qwen2, 3 layers) |" in markdown
    assert "| versions | torch 2.13.0, transformers 5.24.0, python 3.11.7 |" in markdown
    assert "![" in markdown and "(figures/cache_drift_by_layer.png)" in markdown
    assert "layer medians are exactly zero" in markdown
    assert "| transplant demo: donor recovered both ways | 4/4 | — |" in markdown
    page = paths.html.read_text(encoding="utf-8")
    assert len(embedded_images(page)) == len(paths.figures) == 5
    for figure in paths.figures:
        assert figure.read_bytes().startswith(b"\x89PNG")
    assert_self_contained(page)


def test_report_is_reproducible(synthetic_run: Path, tmp_path: Path) -> None:
    first = build_report(synthetic_run, tmp_path / "a")
    second = build_report(synthetic_run, tmp_path / "b")
    assert first.html.read_bytes() == second.html.read_bytes()


def test_report_uses_the_runs_claims(synthetic_run: Path) -> None:
    (synthetic_run / "claims.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(LedgerError, match="claims.json, field schema"):
        build_report(synthetic_run)


def test_report_cli(synthetic_run: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(report, [str(synthetic_run)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {synthetic_run / 'report.html'}"
    missing = CliRunner().invoke(report, [str(tmp_path / "nowhere")])
    assert missing.exit_code == 2
    assert missing.stderr.startswith("kvreplay: error: ") and missing.stderr.count("\n") == 1
