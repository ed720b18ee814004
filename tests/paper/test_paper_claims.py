"""`kvreplay analyze` on the paper's published ledgers reproduces the paper's figures.

Reads ../shared/paper-release (beside the repository); skipped when it is absent.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvreplay.analysis.claims import analyze_dir
from kvreplay.report.commands import analyze

PAPER = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release"
Row = dict[str, str]
pytestmark = pytest.mark.skipif(
    not (PAPER / "data").is_dir(),
    reason=f"the paper's release is not at {PAPER} (clone with shared/ beside the repository)",
)


def key_shape(value: Any) -> Any:
    """The key structure of a JSON value: dict keys recursively, list lengths, no numbers."""
    if isinstance(value, dict):
        return {key: key_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [key_shape(item) for item in value]
    return None


@pytest.fixture(scope="module")
def skeleton() -> dict[str, Any]:
    return json.loads((PAPER / "claims_skeleton.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def claims(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("claims") / "claims.json"
    result = CliRunner().invoke(analyze, [str(PAPER / "data"), "-o", str(output)])
    assert result.exit_code == 0, result.output
    assert f"wrote {output}" in result.output
    return json.loads(output.read_text(encoding="utf-8"))


def test_claims_have_exactly_the_skeleton_keys(claims: dict, skeleton: dict) -> None:
    paper_keys = {key: value for key, value in claims.items() if key != "extra"}
    assert key_shape(paper_keys) == key_shape(skeleton)
    assert claims["schema"] == "stage-replay-paper-claims-v1"


def test_extra_holds_newcombe_beside_the_bootstrap(claims: dict) -> None:
    extra = claims["extra"]["fixed_prefix_2x2"]["bf16"]["accuracy_delta_prefill_minus_left"]
    assert extra["paired_bootstrap_95_ci_pp"] == pytest.approx([-3.5, 5.5], abs=1e-9)
    low, high = extra["newcombe_method10_95_ci_pp"]
    assert low < 1.0 < high
    assert set(claims["extra"]["fixed_prefix_2x2"]["cross_precision"]) == {
        "suffix_mismatch",
        "answer_mismatch",
        "correctness_flip",
        "logits_mismatch",
    }


@pytest.mark.parametrize(
    ("section", "left"), [("matched_live_prefill", "live"), ("fixed_prefix_2x2", "incremental")]
)
def test_bf16_headline(claims: dict, section: str, left: str) -> None:
    bf16 = claims[section]["bf16"]
    assert (bf16["suffix_disagreement"]["count"], bf16["suffix_disagreement"]["n"]) == (166, 200)
    assert (bf16["answer_disagreement"]["count"], bf16["answer_disagreement"]["n"]) == (49, 200)
    label = bf16["correctness_label_disagreement"]
    assert (label["count"], label["n"]) == (20, 200)
    assert (bf16[f"{left}_correct"], bf16["prefill_correct"]) == (93, 95)
    assert bf16["accuracy_delta_prefill_minus_left_pp"] == pytest.approx(1.0)
    assert bf16["accuracy_paired_bootstrap_95_ci_pp"] == pytest.approx([-3.5, 5.5], abs=1e-9)
    assert (bf16[f"{left}_replica_exact_rows"], bf16["prefill_replica_exact_rows"]) == (200, 200)
    # 9 vs 11 discordant labels: p = 2 * 431910 / 2^20
    assert bf16["mcnemar_exact_two_sided_p"] == pytest.approx(0.8238029479980469, rel=1e-12)


@pytest.mark.parametrize("section", ["matched_live_prefill", "fixed_prefix_2x2"])
def test_fp32_zeros_with_wilson_bound(claims: dict, section: str) -> None:
    fp32 = claims[section]["fp32"]
    for endpoint in ("suffix", "trace", "merge", "answer", "correctness_label"):
        payload = fp32[f"{endpoint}_disagreement"]
        assert (payload["count"], payload["n"]) == (0, 200)
        assert payload["wilson_95_ci"][0] == 0.0
        assert round(payload["wilson_95_ci"][1], 5) == 0.01885
    assert fp32["accuracy_delta_prefill_minus_left_pp"] == 0.0


def test_bridge_twelve_of_twelve(claims: dict) -> None:
    bridge = claims["prospective_bridge"]
    assert bridge["rows"] == 12
    for key in (
        "integrity_pass_rows",
        "live_teacher_cache_exact_rows",
        "live_teacher_logits_exact_rows",
        "live_teacher_suffix_exact_rows",
        "all_48_layers_exact_rows",
    ):
        assert bridge[key] == 12, key


@pytest.mark.parametrize(("name", "divergent", "controls"), [("primary", 24, 8), ("later", 43, 5)])
def test_transplant_recovers_donor_both_ways(
    claims: dict, name: str, divergent: int, controls: int
) -> None:
    section = claims[f"transplant_{name}"]
    for key in (
        "incremental_cache_into_prefill_donor_recovery",
        "prefill_cache_into_incremental_donor_recovery",
        "bidirectional_donor_recovery",
    ):
        assert (section[key]["count"], section[key]["n"]) == (divergent, divergent), key
    novel = section["exact_control_novel_trajectory"]
    assert (novel["count"], novel["n"]) == (0, controls)
    assert section["baseline_exact_rows"] == controls


def rewrite(source: Path, target: Path, transform: Callable[[Row], Row | None]) -> None:
    """Copy a ledger to target, transforming each row; None drops the row."""
    with source.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows = [new for row in reader if (new := transform(row)) is not None]
        header = reader.fieldnames or []
    with target.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


def test_any_row_count_and_transplant_name_keep_the_key_shape(
    tmp_path: Path, skeleton: dict
) -> None:
    """Seven items per precision, and a transplant panel under a new name."""
    data = PAPER / "data"
    for name in ("matched_live_prefill.csv", "fixed_prefix_2x2.csv"):
        rewrite(
            data / name, tmp_path / name, lambda row: row if int(row["row_id"][1:]) < 7 else None
        )
    shutil.copy(data / "kv_transplant_later.csv", tmp_path / "kv_transplant_mine.csv")
    claims = analyze_dir(tmp_path).to_json()
    assert claims["fixed_prefix_2x2"]["bf16"]["rows"] == 7
    for section in ("matched_live_prefill", "fixed_prefix_2x2"):
        assert key_shape(claims[section]) == key_shape(skeleton[section])
    assert key_shape(claims["transplant_mine"]) == key_shape(skeleton["transplant_later"])
    assert set(claims) == {
        "schema",
        "matched_live_prefill",
        "fixed_prefix_2x2",
        "transplant_mine",
        "extra",
    }


def test_precisions_are_whatever_the_file_holds(tmp_path: Path, skeleton: dict) -> None:
    """A bf16-only file has no cross-precision keys; an unknown precision gets a full block."""
    data = PAPER / "data"
    fixed = "fixed_prefix_2x2.csv"
    rewrite(data / fixed, tmp_path / fixed, lambda row: row if row["precision"] == "bf16" else None)
    only_bf16 = analyze_dir(tmp_path).to_json()["fixed_prefix_2x2"]
    assert set(only_bf16) == {"bf16"}
    assert key_shape(only_bf16["bf16"]) == key_shape(skeleton["fixed_prefix_2x2"]["bf16"])

    matched = "matched_live_prefill.csv"
    rewrite(
        data / matched,
        tmp_path / matched,
        lambda row: row | {"precision": row["precision"].replace("fp32", "fp16")},
    )
    blocks = analyze_dir(tmp_path).to_json()["matched_live_prefill"]
    assert set(blocks) == {"bf16", "fp16"}
    assert key_shape(blocks["fp16"]) == key_shape(skeleton["matched_live_prefill"]["fp32"])
