"""Issue 49, item 6: what ``kvreplay mismatch`` writes is valid wherever it is read: its
``--json`` strict JSON (a mismatch past float range capped or written as null, never
``Infinity`` or ``NaN``), its ``--junit`` XML every parser reads (what XML cannot hold, U+FFFE in an
id, escaped), and a logged line whose JSON string holds U+2028 read as the one line it
is (JSONL is split on newlines only); an id holding a control character, which no
CSV line or XML attribute carries as given, is refused as its line."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
from helpers import check, invoke

LINES = [
    {"id": "nonchar\ufffeid", "prompt_ids": [1, 2], "response_ids": [3, 4],
     "rollout_logprobs": [-1000.0, -0.5], "trainer_logprobs": [0.0, -0.5]},
    {"id": "separator\u2028id", "prompt_ids": [1, 2], "response_ids": [3, 4],
     "rollout_logprobs": [-0.5, -0.5], "trainer_logprobs": [-0.5, -0.5]},
]  # fmt: skip


def strict(path: Path) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


@pytest.fixture
def logged(tmp_path: Path) -> Path:
    path = tmp_path / "logged.jsonl"
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in LINES), "utf-8")
    return path


def test_a_gate_writes_strict_json_and_junit_a_parser_reads(logged: Path, tmp_path: Path) -> None:
    out_json, out_xml = tmp_path / "verdict.json", tmp_path / "verdict.xml"
    result = invoke("mismatch", logged, "--max-k3-kl", 1, "--json", out_json, "--junit", out_xml)
    assert result.exit_code == 1, result.output
    assert "RuntimeWarning" not in result.stderr
    verdict = strict(out_json)
    # exp(1000) is past float range: capped at exp(300) (a finite number), never Infinity
    kl_k3 = verdict["levels"]["numbers"]["kl_k3"]
    assert kl_k3 > 1e100
    names = [c.get("name") for c in ElementTree.parse(out_xml).getroot().iter("testcase")]
    assert names == ["nonchar\\ufffeid", "separator\u2028id", "kl_k3"]  # each rollout by its id


def test_the_claims_without_a_gate_are_strict_json(logged: Path, tmp_path: Path) -> None:
    result = invoke("mismatch", logged, "--json", tmp_path / "claims.json")
    assert result.exit_code == 0, result.output
    claims = strict(tmp_path / "claims.json")
    assert claims["logged"]["sequences"] == 2  # both lines read, U+2028 and all


@pytest.mark.parametrize("logprob", [-1e300, -1.7e308])
def test_a_log_probability_past_any_float32_is_refused(tmp_path: Path, logprob: float) -> None:
    # it would overflow the sums (a warning on the terminal) or turn k3 negative (a gate held)
    path = tmp_path / "logged.jsonl"
    line = {**LINES[1], "rollout_logprobs": [logprob, -0.5]}
    path.write_text(json.dumps(line) + "\n", "utf-8")
    result = invoke("mismatch", path, "--max-k3-kl", 1, "--json", tmp_path / "v.json")
    check(result, "at least -3.403e+38", tmp_path / "none")
    assert not (tmp_path / "v.json").exists()


@pytest.mark.parametrize("character", ["\x00", "\x01", "\r", "\x1b", "\x85"])
def test_an_id_holding_a_control_character_is_refused(tmp_path: Path, character: str) -> None:
    path = tmp_path / "logged.jsonl"
    line = {**LINES[1], "id": f"a{character}b"}
    path.write_text(json.dumps(line, ensure_ascii=False) + "\n", "utf-8")
    check(invoke("mismatch", path, "--json", tmp_path / "v.json"), "holds a control character",
          tmp_path / "none")  # fmt: skip
    assert not (tmp_path / "v.json").exists()
