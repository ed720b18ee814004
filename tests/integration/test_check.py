"""``kvreplay check`` (issues 27, 33) end to end through the CLI, on drift_qwen2 (whose
bf16 prefill drifts from decode by construction, on every kernel family): the verdict at
both levels, its exit code, the JSON (validated against docs/check-v4.schema.json), the
JUnit XML (read back by an XML parser), the repro pack whose command reproduces the first
divergence, the audit of the check's own run folder, ``--expect bitwise`` stopping at the
first item whose numerics part, ``--max-rate``, the pytest helper, and bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import jsonschema
import pytest
from helpers import invoke, pool_inputs

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "docs" / "check-v4.schema.json").read_text())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The prompt pool as items, and the tests' stage plan as a plan file."""
    return pool_inputs(tmp_path_factory.mktemp("check-inputs"))


def check(
    tiny_dirs, inputs, out: Path, *extra: object, model: str = "drift_qwen2", n: int | None = 16
):
    items, plan = inputs
    count = ("--n", n) if n is not None else ()
    return invoke(
        "check", "--model", tiny_dirs[model], "--items", items, "--plan", plan,
        *count, "--out", out, *extra,
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
    assert output.startswith(
        "FAILS at token level (every suffix equal): live and prefill continuations differ"
    )
    # how many items part in their bits depends on the CPU's kernels; every divergent one does
    parted = r"NOT bitwise: live and prefill numerics differ on \d+ of 16 item\(s\)"
    assert re.search(parted, output)
    verdict = json.loads((bf16 / "v.json").read_text())
    jsonschema.validate(verdict, SCHEMA)
    assert verdict["verdict"] == "fails" and verdict["exit_code"] == 1
    assert verdict["counts"]["suffixes_differ"] >= 1
    diverging = [i for i in verdict["items"] if i["suffix_differs"]]
    assert all(
        i["first_divergence"] is not None and i["left_margin"] is not None for i in diverging
    )
    assert verdict["environment"]["model"]["model_digest"]
    bits = verdict["levels"]["bits"]
    assert bits["holds"] is False and verdict["counts"]["suffixes_differ"] <= bits["differ"] <= 16
    parts = [i["item_id"] for i in verdict["items"] if i["bits"] == "differ"]
    assert bits["first"] == {"item_id": parts[0], "precision": "bf16", "step": 0}
    assert all(i["bits"] == "differ" and i["kv_equal"] is False for i in diverging)


def test_junit_has_one_case_per_item_and_fails_the_divergent_ones(bf16: Path) -> None:
    suite = ElementTree.parse(bf16 / "v.xml").getroot()
    verdict = json.loads((bf16 / "v.json").read_text())
    cases = suite.findall("testcase")
    assert suite.tag == "testsuite" and len(cases) == 16 == int(suite.get("tests"))
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert failed == {i["item_id"] for i in verdict["items"] if i["suffix_differs"]}
    assert int(suite.get("failures")) == len(failed)
    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert properties["tokens"] == "fails" and properties["bits"] == "fails"
    case_bits = {c.find("properties/property[@name='bits']").get("value") for c in cases}
    assert "differ" in case_bits and case_bits <= {"differ", "equal"}


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
    """drift_qwen2 drifts by construction in every precision; a plain Qwen2 in fp32 not.
    A pass states its power and what the bits level gives, never a bare HOLDS."""
    result = check(
        tiny_dirs, inputs, tmp_path / "run", "--dtypes", "fp32", "--json", tmp_path / "v.json",
        model="qwen2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.startswith("HOLDS at token level (every suffix equal)")
    assert "the divergence rate may still be up to 21% (95% upper bound)" in result.output
    verdict = json.loads((tmp_path / "v.json").read_text())
    jsonschema.validate(verdict, SCHEMA)
    assert verdict["power"]["rate_upper_95"] == pytest.approx(1 - 0.025 ** (1 / 16))
    bits = "bitwise too" if verdict["levels"]["bits"]["holds"] else "NOT bitwise"
    assert bits in result.output
    assert not (tmp_path / "run.repro").exists()


def test_bitwise_stops_at_the_first_item_whose_numerics_part(tmp_path, tiny_dirs, inputs) -> None:
    result = check(
        tiny_dirs, inputs, tmp_path / "run", "--expect", "bitwise", "--json",
        tmp_path / "v.json", "--junit", tmp_path / "v.xml",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    first = re.match(
        r"FAILS bitwise \(every compared step bit-equal\): live and prefill numerics differ on "
        r"1 of (\d+) item\(s\), first at item p(\d+) \(bf16\) from step 0 \(the boundary logits\)",
        result.output,
    )
    assert first is not None, result.output  # which item parts first depends on the kernels
    ran = int(first.group(2)) + 1
    assert int(first.group(1)) == ran
    assert f"stopped after {ran} of 16 planned item row(s)" in result.output
    verdict = json.loads((tmp_path / "v.json").read_text())
    jsonschema.validate(verdict, SCHEMA)
    assert verdict["stopped_early"] and verdict["level"] == "bits"
    assert len((tmp_path / "run" / "rows.jsonl").read_text().splitlines()) == ran
    pack = json.loads((tmp_path / "run.repro" / "repro.json").read_text())
    assert pack["item_id"] == f"p{ran - 1}" and pack["numeric_divergence"] == 0
    assert invoke("audit", tmp_path / "run").exit_code == 0  # a stopped check still audits


def test_max_rate_runs_the_items_a_pass_needs(tmp_path, tiny_dirs, inputs) -> None:
    """0 of n bounds the rate under 0.5 from n = 6 on; a failing stack stops at its first
    divergent item instead."""
    passing = check(
        tiny_dirs, inputs, tmp_path / "pass", "--dtypes", "fp32", "--max-rate", 0.5,
        "--json", tmp_path / "pass.json", model="qwen2", n=None,
    )  # fmt: skip
    assert passing.exit_code == 0, passing.output
    verdict = json.loads((tmp_path / "pass.json").read_text())
    assert verdict["power"]["items_needed"] == 6 == len(verdict["items"])
    assert verdict["power"]["rate_upper_95"] < 0.5
    failing = check(
        tiny_dirs, inputs, tmp_path / "fail", "--max-rate", 0.5, "--json",
        tmp_path / "fail.json", n=None,
    )  # fmt: skip
    assert failing.exit_code == 1, failing.output
    verdict = json.loads((tmp_path / "fail.json").read_text())
    assert verdict["stopped_early"] and verdict["counts"]["suffixes_differ"] == 1
    assert verdict["items"][-1]["suffix_differs"]
    too_few = check(tiny_dirs, inputs, tmp_path / "few", "--max-rate", 0.05, n=None)
    assert too_few.exit_code == 2 and "needs 72 items" in too_few.output
    assert "holds 16" in too_few.output and not (tmp_path / "few").exists()


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
        (("--temperature", 0.7, "--margin", 1.5), "1.5 is not in the range 0<=x<=1"),
        (("--margin", 0.1), "--margin applies to --expect faithful only"),
        (("--samples", 8), "--samples applies at --temperature above 0 only"),
        (("--max-rate", 0), "--max-rate is a divergence rate strictly between 0 and 1"),
        (("--max-rate", 1.5), "'--max-rate': 1.5 is not in the range 0<=x<=1"),
        (("--max-rate", "nan"), "got nan"),
        (("--max-rate", 0.05), "--max-rate 0.05 sets how many items run (72); leave out --n"),
        (("--expect", "bitwise", "--temperature", 0.7), "at --temperature above 0 use"),
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


PLUGIN = '''
from dataclasses import dataclass

from kvreplay.backends.base import Backend, Capabilities


@dataclass(frozen=True)
class Blind(Backend):
    """A third-party backend that reports tokens only: no logits, no logprobs."""

    name = "blind"
    summary = "tokens only"
    capabilities = Capabilities(kv_access=False, cache_control=True)
'''


def test_bitwise_on_a_backend_without_numerics_is_refused(tmp_path: Path, tiny_dirs) -> None:
    """A backend registered by another package (an entry point) that reports neither
    logits nor logprobs: a bitwise check is refused in one sentence before any write."""
    (tmp_path / "blind_backend.py").write_text(PLUGIN)
    info = tmp_path / "blind_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: blind-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvreplay.backends]\nblind = blind_backend:Blind\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvreplay", "check", "--backend", "blind", "--expect", "bitwise",
         "--model", str(tiny_dirs["qwen2"]), "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "the blind backend reports neither logits nor top-k logprobs" in done.stderr
    assert not (tmp_path / "run").exists()


def test_fragile_selection_checks_the_riskiest_screened_items_first(
    tmp_path: Path, tiny_dirs, inputs
) -> None:
    """--select fragile screens the first 8 items (one short live generation each) and runs
    the 3 whose early live margins come nearest a tie, riskiest first; audit re-derives
    the choice from the recorded screens."""
    out = tmp_path / "run"
    result = check(tiny_dirs, inputs, out, "--select", "fragile", "--screen", 8, n=3)
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    screens = [r["data"] for r in records if r["data"].get("kind") == "prefix"]
    rows = [r["data"]["item_id"] for r in records if r["data"].get("kind") != "prefix"]
    assert [s["item_id"] for s in screens] == [f"p{i}" for i in range(8)]
    assert all(0 < len(s["screen_margins"]) <= 32 for s in screens)
    by_risk = sorted(screens, key=lambda s: min(s["screen_margins"]))  # stable: item order
    assert rows == [s["item_id"] for s in by_risk[:3]]
    assert invoke("audit", out, "--sample", 2).exit_code == 0
    for extra, message in (
        (("--screen", 8), "--screen applies to --select fragile only"),
        (("--select", "fragile", "--screen", 2), "--screen must be from --n (3)"),
    ):
        refused = check(tiny_dirs, inputs, tmp_path / "bad", *extra, n=3)
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert not (tmp_path / "bad").exists()
