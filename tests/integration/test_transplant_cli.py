"""``kvreplay run transplant`` and ``kvreplay run localize`` end to end on a tiny model:
a fixed-prefix source run, stratified and blind panels, localisation, analysis, audit,
resume, and bad input that must end in one sentence and exit code 2."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from helpers import find_divergence

from kvreplay.cli import main
from kvreplay.core.stages import Stage, StagePlan
from kvreplay.experiments.transplant.table import TRANSPLANT_TABLE

PAPER_COLUMNS = [c.name for c in TRANSPLANT_TABLE.columns if c.use == "required"]
PAPER_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release" / "data"
PLAN = StagePlan(
    name="test-transplant",
    stages=(
        Stage("think", max_new_tokens=24),
        Stage("trace", max_new_tokens=24),
        Stage("answer", max_new_tokens=4, opener="\nA:"),
    ),
)


@pytest.fixture(scope="module")
def setup(tiny_dirs, tiny_lm, tmp_path_factory) -> dict[str, Path]:
    """drift_qwen2, a plan file, two items (p0 divergent, p1 exact), a fixed-prefix run.

    drift_qwen2's prefill drifts by construction (tests/tiny.py), so a bounded prompt
    pool holds both kinds of item on every kernel family; the search fails loudly if not.
    """
    root = tmp_path_factory.mktemp("transplant")
    (root / "plan.json").write_text(json.dumps(PLAN.to_dict()))
    found = find_divergence(tiny_lm("drift_qwen2", "bf16"), PLAN)
    prompts = (found.divergent[0], found.exact[0])
    items = [{"id": f"p{i}", "prompt": prompts[i], "answer": 23} for i in (0, 1)]
    (root / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    paths = {"root": root, "model": tiny_dirs["drift_qwen2"], "source": root / "source"}
    _ok(_run(paths, "fixed-prefix", paths["source"]))
    return paths


def _run(paths: dict[str, Path], experiment: str, out: Path, *extra: str) -> Result:
    root = paths["root"]
    args = ["run", experiment, "--model", str(paths["model"]), "--out", str(out)]
    args += ["--items", str(root / "items.jsonl"), "--plan", str(root / "plan.json")]
    return CliRunner().invoke(main, [*args, "--dtypes", "bf16", *extra])


def _ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output + result.stderr
    return result


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _check_paper_header(path: Path) -> list[str]:
    header = path.read_text(encoding="utf-8").splitlines()[0].split(",")
    assert header[: len(PAPER_COLUMNS)] == PAPER_COLUMNS
    paper = PAPER_DATA / "kv_transplant_primary.csv"
    if paper.exists():
        assert header[: len(PAPER_COLUMNS)] == paper.read_text().splitlines()[0].split(",")
    return header


def _assert_gates(rows: list[dict[str, str]]) -> None:
    for row in rows:
        for flag in ("integrity_pass", "historical_stratum_reproduced", "boundary_argmax_equal"):
            assert row[flag] == "true", (row["row_id"], flag)
        assert row["all_48_layer_pairs_transplanted"] == "true"
        assert row["num_layers"] == "3"
        # Equal boundary argmaxes make every full transplant follow its donor exactly.
        assert row["bidirectional_donor_recovery"] == "true"
        assert row["exact_control_novel_trajectory"] == "false"


@pytest.fixture(scope="module")
def stratified(setup) -> Path:
    out = setup["root"] / "stratified"
    _ok(_run(setup, "transplant", out, "--from", str(setup["source"]), "--alias", "T0",
             "--divergent", "1", "--controls", "1"))  # fmt: skip
    return out


def test_stratified_panel_writes_the_paper_ledger(setup, stratified: Path) -> None:
    path = stratified / "kv_transplant_primary.csv"
    header = _check_paper_header(path)
    assert {"precision", "num_layers", "first_suffix_divergence_index"} <= set(header)
    rows = _rows(path)
    assert [(r["row_id"], r["historical_stratum"], r["baseline_divergent"]) for r in rows] == [
        ("p0", "divergent", "true"),
        ("p1", "exact", "false"),
    ]
    assert {r["checkpoint_alias"] for r in rows} == {"T0"}
    assert {r["selection_basis"] for r in rows} == {"prior_outcome_stratified_length_spread"}
    _assert_gates(rows)
    manifest = json.loads((stratified / "manifest.json").read_text())
    selection = manifest["experiments"]["transplant"]["config"]["selection"]
    assert selection["available"] == {"divergent": 1, "exact": 1}
    assert [r["item_id"] for r in selection["rows"]] == ["p0", "p1"]

    analysis = CliRunner().invoke(main, ["analyze", str(stratified)])
    assert analysis.exit_code == 0, analysis.output
    claims = json.loads((stratified / "claims.json").read_text())
    section = claims["transplant_primary"]
    assert section["bidirectional_donor_recovery"]["count"] == 1
    assert section["exact_control_novel_trajectory"]["count"] == 0


def test_a_rerun_resumes_without_new_rows(setup, stratified: Path) -> None:
    before = (stratified / "rows.jsonl").read_bytes()
    _ok(_run(setup, "transplant", stratified, "--from", str(setup["source"]), "--alias", "T0",
             "--divergent", "1", "--controls", "1"))  # fmt: skip
    assert (stratified / "rows.jsonl").read_bytes() == before


def test_audit_re_executes_the_transplant_run(stratified: Path) -> None:
    result = CliRunner().invoke(main, ["audit", str(stratified)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


def test_blind_panel_is_chosen_before_any_row(setup) -> None:
    out = setup["root"] / "blind"
    _ok(_run(setup, "transplant", out, "--panel", "blind", "--n", "1", "--alias", "C1"))
    rows = _rows(out / "kv_transplant_later.csv")
    assert len(rows) == 1
    assert rows[0]["historical_stratum"] == "not_used"
    assert rows[0]["selection_basis"] == "outcome_blind_length_and_identifier"
    _assert_gates(rows)
    manifest = json.loads((out / "manifest.json").read_text())
    selection = manifest["experiments"]["transplant"]["config"]["selection"]
    assert selection["seed"] == 0 and selection["length_basis"] == "prompt_tokens"
    assert [r["item_id"] for r in selection["rows"]] == [rows[0]["row_id"]]
    ledger = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["data"]["kind"] for r in ledger] == ["prefix", "transplant"]
    assert ledger[0]["data"]["source"]["generated"] is True


def test_localize_writes_a_tidy_table_and_a_figure(setup) -> None:
    out = setup["root"] / "localize"
    _ok(_run(setup, "localize", out, "--from", str(setup["source"])))
    rows = _rows(out / "localize.csv")
    assert {r["row_id"] for r in rows} == {"p0"}  # the source's only divergent row
    assert {r["direction"] for r in rows} == {"incremental_cache_into_prefill"}
    sweeps = {r["sweep"] for r in rows}
    assert {"single", "prefix", "suffix", "component", "bisect"} <= sweeps
    assert sorted(r["layers"] for r in rows if r["sweep"] == "single") == ["0", "1", "2"]
    assert {r["component"] for r in rows if r["sweep"] == "component"} == {"k", "v"}
    full = [r for r in rows if r["sweep"] == "prefix" and r["layers"] == "0-2"]
    assert full[0]["recovers_donor"] == "true" and full[0]["first_divergence_index"] == ""
    for row in rows:
        assert (row["recovers_donor"] == "true") == (row["first_divergence_index"] == "")
        assert (row["recovers_donor"] == "true") == (row["suffix_sha256"] != "")
    assert (out / "figures" / "localize.png").stat().st_size > 1000


BAD_INPUT = {
    "more divergent rows than the source has": (
        "transplant",
        ("--divergent", "2", "--controls", "0"),
        "has 1 divergent bf16 rows but the panel asks for 2",
    ),
    "more controls than the source has": (
        "transplant",
        ("--divergent", "1", "--controls", "3"),
        "has 1 exact bf16 rows but the panel asks for 3",
    ),
    "a ledger name that is not a file-name word": (
        "transplant",
        ("--divergent", "1", "--controls", "0", "--name", "a b"),
        "--name 'a b' may hold only",
    ),
    "localize asking for more divergent rows": (
        "localize",
        ("--divergent", "4"),
        "has 1 divergent bf16 rows",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_panels_end_in_one_sentence_before_anything_is_written(setup, case: str) -> None:
    experiment, extra, message = BAD_INPUT[case]
    out = setup["root"] / f"bad-{case.replace(' ', '-')}"
    result = _run(setup, experiment, out, "--from", str(setup["source"]), *extra)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not out.exists()


def test_a_stratified_panel_needs_a_source_run(setup) -> None:
    out = setup["root"] / "no-source"
    result = _run(setup, "transplant", out)
    assert result.exit_code == 2 and "pass --from RUN_DIR" in result.stderr
    assert not out.exists()


def test_a_source_run_of_another_model_is_refused(setup, tiny_dirs) -> None:
    out = setup["root"] / "other-model"
    result = _run({**setup, "model": tiny_dirs["llama"]}, "localize", out,
                  "--from", str(setup["source"]))  # fmt: skip
    assert result.exit_code == 2 and "(--from) ran on the model" in result.stderr
    assert not out.exists()
