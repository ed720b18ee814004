"""`kvreplay report` on the paper's ledgers and on a synthetic kvreplay run directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvreplay.harness.table import LedgerError
from kvreplay.report.build import build_report
from kvreplay.report.commands import report

PAPER_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release" / "data"


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
