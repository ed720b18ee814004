"""`analyze` and `report` add the flip predictor to a committed run, and skip it on bare CSVs.

Works on a copy of results/smollm2-n24 in tmp_path: committed results are never written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import invoke

from kvreplay.analysis.flip import PRIMARY_SCORE, SCORES
from kvreplay.analysis.ledgers import load_ledger_dir
from kvreplay.analysis.sections import flip
from kvreplay.analysis.sections.flip import SKIP_NO_ROWS
from kvreplay.core.claims import encode

RUN = Path(__file__).resolve().parents[2] / "results" / "smollm2-n24"
pytestmark = pytest.mark.skipif(not (RUN / "rows.jsonl").is_file(), reason=f"{RUN} is absent")


@pytest.fixture(scope="module")
def run_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed run, analysed and reported in a temporary folder."""
    run = tmp_path_factory.mktemp("flip") / RUN.name
    shutil.copytree(RUN, run)
    (run / "claims.json").unlink()  # so report reads the claims analyze writes
    result = invoke("analyze", run)
    assert result.exit_code == 0, result.output
    assert f"flip_predictor matched_live_prefill bf16 (15/24 divergent): {PRIMARY_SCORE}" in (
        result.output
    )
    result = invoke("report", run)
    assert result.exit_code == 0, result.output
    return run


def test_claims_carry_the_flip_section_beside_the_paper_keys(run_copy: Path) -> None:
    claims = json.loads((run_copy / "claims.json").read_text(encoding="utf-8"))
    committed = json.loads((RUN / "claims.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in claims.items() if k != "extra"} == {
        k: v for k, v in committed.items() if k != "extra"
    }
    flip = claims["extra"]["flip_predictor"]
    assert flip["primary_score"] == PRIMARY_SCORE
    assert set(flip["scores"]) == {s.name for s in SCORES}
    for section in ("matched_live_prefill", "fixed_prefix_2x2"):
        bf16, fp32 = flip[section]["bf16"], flip[section]["fp32"]
        assert (bf16["rows"], bf16["divergent_rows"]) == (24, 15)
        assert bf16["divergent_rows"] == claims[section]["bf16"]["suffix_disagreement"]["count"]
        for result in bf16["scores"].values():
            low, high = result["auc_bootstrap_95_ci"]
            assert 0.0 <= low <= result["auc"] <= high <= 1.0
            audit = result["audit_top_share"]
            assert audit["audited_rows"] == 5
            assert 0 <= audit["divergent_caught"] <= 5
            low, high = audit["bootstrap_95_ci"]
            assert 0.0 <= low <= high <= 1.0
        assert fp32["divergent_rows"] == 0
        assert fp32["auc_status"].startswith("undefined")
        assert all(r["auc"] is None for r in fp32["scores"].values())


def test_report_draws_the_roc_and_tabulates_the_auc(run_copy: Path) -> None:
    assert (run_copy / "figures" / "flip_predictor_roc.png").stat().st_size > 0
    markdown = (run_copy / "report.md").read_text(encoding="utf-8")
    assert "## Flip predictor" in markdown
    assert "figures/flip_predictor_roc.png" in markdown
    assert f"| matched_live_prefill | bf16 | {PRIMARY_SCORE} | 15/24 | 0." in markdown
    assert "undefined: no row diverges" in markdown


def test_csv_only_folder_skips_the_predictor_with_a_note(tmp_path: Path) -> None:
    for name in ("matched_live_prefill.csv", "fixed_prefix_2x2.csv"):
        shutil.copy(RUN / name, tmp_path / name)
    result = invoke("analyze", tmp_path)
    assert result.exit_code == 0, result.output
    claims = json.loads((tmp_path / "claims.json").read_text(encoding="utf-8"))
    assert claims["extra"]["flip_predictor"] == {"note": SKIP_NO_ROWS}
    assert "flip_predictor: The flip predictor needs" in result.output
    result = invoke("report", tmp_path)
    assert result.exit_code == 0, result.output
    assert SKIP_NO_ROWS in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert not (tmp_path / "figures" / "flip_predictor_roc.png").exists()


def test_rows_without_margins_skip_the_predictor_with_a_note(run_copy: Path) -> None:
    """A ledger from before margins were kept: the section says so instead of failing."""
    folder = load_ledger_dir(run_copy)
    assert folder.records is not None
    records = list(folder.records)
    for record in records:
        for segment in (
            record.data.get("arms", {}).get("left", {}).get("suffix", {}).get("segments", [])
        ):
            del segment["margins"]
    analysis = flip.analyze_flip(records, folder.ledgers)
    assert analysis.panels == ()
    assert analysis.skipped == flip.SKIP_NO_MARGINS.format(row="matched/r0000/bf16")
    assert encode(analysis.claims()) == {"note": analysis.skipped}
