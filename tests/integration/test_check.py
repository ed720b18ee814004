"""``kvreplay check`` (issue 27) end to end through the CLI, on drift_qwen2 (whose bf16
prefill drifts from decode by construction, on every kernel family): the verdict, its
exit code, the JSON (validated against docs/check-v1.schema.json), the JUnit XML (read
back by an XML parser), the repro pack whose command reproduces the first divergence,
the audit of the check's own run folder, the pytest helper, and bad input."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import jsonschema
import pytest
from helpers import PLAN, PROMPT_POOL, invoke, write_items

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "docs" / "check-v1.schema.json").read_text())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The prompt pool as items, and the tests' stage plan as a plan file."""
    root = tmp_path_factory.mktemp("check-inputs")
    items = write_items(root / "items.jsonl", PROMPT_POOL, "p", "1")
    plan = root / "plan.json"
    plan.write_text(json.dumps(PLAN.to_dict()))
    return items, plan


def check(tiny_dirs, inputs, out: Path, *extra: object, model: str = "drift_qwen2"):
    items, plan = inputs
    return invoke(
        "check", "--model", tiny_dirs[model], "--items", items, "--plan", plan,
        "--n", 16, "--out", out, *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, tiny_dirs, inputs) -> Path:
    root = tmp_path_factory.mktemp("check-bf16")
    result = check(
        tiny_dirs, inputs, root / "run", "--json", root / "v.json", "--junit", root / "v.xml"
    )
    assert result.exit_code == 1, result.output
    (root / "stdout.txt").write_text(result.output)
    return root


def test_bf16_fails_exact_with_its_divergences(bf16: Path) -> None:
    output = (bf16 / "stdout.txt").read_text()
    assert output.startswith("FAILS (every suffix equal): live and prefill continuations differ")
    verdict = json.loads((bf16 / "v.json").read_text())
    jsonschema.validate(verdict, SCHEMA)
    assert verdict["verdict"] == "fails" and verdict["exit_code"] == 1
    assert verdict["counts"]["suffixes_differ"] >= 1
    diverging = [i for i in verdict["items"] if i["suffix_differs"]]
    assert all(
        i["first_divergence"] is not None and i["left_margin"] is not None for i in diverging
    )
    assert verdict["environment"]["model"]["model_digest"]


def test_junit_has_one_case_per_item_and_fails_the_divergent_ones(bf16: Path) -> None:
    suite = ElementTree.parse(bf16 / "v.xml").getroot()
    verdict = json.loads((bf16 / "v.json").read_text())
    cases = suite.findall("testcase")
    assert suite.tag == "testsuite" and len(cases) == 16 == int(suite.get("tests"))
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert failed == {i["item_id"] for i in verdict["items"] if i["suffix_differs"]}
    assert int(suite.get("failures")) == len(failed)


def test_the_repro_pack_command_reproduces_the_first_divergence(bf16: Path) -> None:
    pack = json.loads((bf16 / "run.repro" / "repro.json").read_text())
    first = next(
        i for i in json.loads((bf16 / "v.json").read_text())["items"] if i["suffix_differs"]
    )
    assert (
        pack["item_id"] == first["item_id"]
        and pack["first_divergence"] == first["first_divergence"]
    )
    args = shlex.split(pack["command"])
    assert args[:2] == ["kvreplay", "check"] and "--n" in args
    again = invoke(*args[1:], "--json", bf16 / "again.json")
    assert again.exit_code == 1, again.output
    rerun = json.loads((bf16 / "again.json").read_text())
    assert [i["item_id"] for i in rerun["items"]] == [pack["item_id"]]
    assert rerun["items"][0]["first_divergence"] == pack["first_divergence"]


def test_the_check_is_a_run_that_audit_reexecutes(bf16: Path) -> None:
    result = invoke("audit", bf16 / "run", "--sample", 2)
    assert result.exit_code == 0, result.output


def test_fp32_holds_on_a_model_whose_prefill_matches_decode(tmp_path, tiny_dirs, inputs) -> None:
    """drift_qwen2 drifts by construction in every precision; a plain Qwen2 in fp32 not."""
    result = check(tiny_dirs, inputs, tmp_path / "run", "--dtypes", "fp32", model="qwen2")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("HOLDS (every suffix equal)")
    assert not (tmp_path / "run.repro").exists()


def test_max_divergent_sets_how_many_may_differ(bf16: Path, tiny_dirs, inputs) -> None:
    differ = json.loads((bf16 / "v.json").read_text())["counts"]["suffixes_differ"]
    allowed = check(tiny_dirs, inputs, bf16 / "run", "--max-divergent", differ)
    assert allowed.exit_code == 0, allowed.output  # resumed: no row runs again
    assert f"at most {differ} item(s) divergent" in allowed.output
    assert check(tiny_dirs, inputs, bf16 / "run", "--max-divergent", differ - 1).exit_code == 1


def test_sampled_check_is_judged_by_the_certificate(tmp_path: Path, tiny_dirs, inputs) -> None:
    result = check(
        tiny_dirs, inputs, tmp_path / "run", "--temperature", 0.7, "--samples", 4, "--n", 3,
        "--json", tmp_path / "v.json",
    )  # fmt: skip
    verdict = json.loads((tmp_path / "v.json").read_text())
    jsonschema.validate(verdict, SCHEMA)
    assert verdict["expectation"]["kind"] == "faithful"
    assert verdict["certificate"]["verdict"] in ("faithful", "not faithful", "undecided")
    assert result.exit_code == (0 if verdict["certificate"]["verdict"] == "faithful" else 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--expect", "identical"), "Invalid value for '--expect'"),
        (("--expect", "faithful"), "give --temperature above 0"),
        (("--temperature", 0.7, "--margin", 1.5), "--margin must lie in (0, 1)"),
        (("--margin", 0.1), "--margin applies to --expect faithful only"),
        (("--samples", 8), "--samples applies at --temperature above 0 only"),
    ],
)
def test_bad_input_is_one_sentence_and_writes_nothing(
    tmp_path: Path, tiny_dirs, inputs, extra: tuple, message: str
) -> None:
    result = check(tiny_dirs, inputs, tmp_path / "run", *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


EXAMPLE = REPO / "docs" / "testing.md"


def test_the_documented_pytest_example_runs(tmp_path: Path, tiny_dirs, monkeypatch) -> None:
    """docs/testing.md's example test, run by pytest as another project would run it."""
    code = EXAMPLE.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "test_replay.py").write_text(code)
    monkeypatch.setenv("KVREPLAY_EXAMPLE_MODEL", str(tiny_dirs["qwen2"]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
