"""Cut-and-refeed items (issue 38): ``kvreplay items cut-refeed`` writes seeded cuts of
greedy generations as token-id prompts, and a run takes them as they are: frozen into its
items.jsonl, fed without a template, audited by re-execution."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import invoke


def cut(tiny_dirs, out: Path, *extra: object):
    return invoke(
        "items", "cut-refeed", "--model", tiny_dirs["qwen2"], "--sources", 2, "--cuts", 3,
        "--tokens", 16, "--out", out, *extra,
    )  # fmt: skip


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def refeed(tmp_path_factory, tiny_dirs) -> Path:
    out = tmp_path_factory.mktemp("refeed") / "cuts.jsonl"
    result = cut(tiny_dirs, out, "--seed", 7)
    assert result.exit_code == 0, result.output
    assert f"to {out}" in result.output
    return out


def test_cuts_are_seeded_points_inside_each_generation(refeed: Path, tiny_dirs, tmp_path) -> None:
    items = read(refeed)
    assert items and len(items) <= 6
    by_source: dict[str, list[dict]] = {}
    for item in items:
        meta = item["meta"]
        assert meta["set"] == "cut-refeed" and meta["seed"] == 7
        assert item["id"] == f"{meta['source']}-cut{meta['cut']}"
        assert len(item["prompt"]) == meta["cut"]
        # a cut leaves a generated token before it and one after it
        assert meta["prompt_tokens"] < meta["cut"] < meta["prompt_tokens"] + meta["generated"]
        by_source.setdefault(meta["source"], []).append(item)
    for cuts in by_source.values():  # one generation: every cut is a prefix of the longest
        longest = max(cuts, key=lambda i: len(i["prompt"]))["prompt"]
        assert all(longest[: len(i["prompt"])] == i["prompt"] for i in cuts)
    again = tmp_path / "again.jsonl"
    assert cut(tiny_dirs, again, "--seed", 7).exit_code == 0
    assert again.read_bytes() == refeed.read_bytes()
    other = tmp_path / "other.jsonl"
    assert cut(tiny_dirs, other, "--seed", 8).exit_code == 0
    assert [i["meta"]["cut"] for i in read(other)] != [i["meta"]["cut"] for i in items]


def test_a_run_takes_the_token_ids_as_they_are_and_audits(
    refeed: Path, tiny_dirs, tmp_path
) -> None:
    out = tmp_path / "run"
    result = invoke(
        "run", "matched", "--model", tiny_dirs["qwen2"], "--items", refeed, "--plan", "short",
        "--n", 2, "--dtypes", "fp32", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    frozen = read(out / "items.jsonl")
    assert [i["prompt"] for i in frozen] == [i["prompt"] for i in read(refeed)]
    rows = [json.loads(line)["data"] for line in (out / "rows.jsonl").read_text().splitlines()]
    firsts = {r["item_id"]: r for r in rows if r.get("kind") != "prefix"}
    assert len(firsts) == 2
    for item in read(refeed)[:2]:  # the live prefix starts with the item's ids, untemplated
        row = firsts[item["id"]]
        assert row["prompt_token_count"] == len(item["prompt"]), row.keys()
    table = list(csv.DictReader((out / "matched_live_prefill.csv").open()))
    assert len(table) == 2
    audited = invoke("audit", out, "--sample", 1)
    assert audited.exit_code == 0 and "PASS" in audited.output, audited.output


@pytest.mark.parametrize(
    ("extra", "sentence"),
    [
        (("--cuts", 0), "'--cuts': 0 is not in the range 1<=x<=64."),
        (("--tokens", 3, "--cuts", 6), "--tokens (3) must exceed --cuts (6)"),
        (("--sources", 100), "'--sources': 100 is not in the range 1<=x<=64."),
        (("--from", "nowhere.jsonl"), "neither a built-in set"),
    ],
)
def test_bad_input_is_refused_in_one_sentence(tiny_dirs, tmp_path, extra, sentence) -> None:
    out = tmp_path / "cuts.jsonl"
    result = cut(tiny_dirs, out, *extra)
    assert result.exit_code == 2 and sentence in result.output, result.output
    assert result.output.count("\n") == 1 and not out.exists()


def test_an_existing_file_or_a_missing_folder_is_refused(tiny_dirs, tmp_path) -> None:
    there = tmp_path / "there.jsonl"
    there.write_text("keep\n")
    result = cut(tiny_dirs, there)
    assert result.exit_code == 2 and "already exists" in result.output
    assert there.read_text() == "keep\n"
    result = cut(tiny_dirs, tmp_path / "no" / "cuts.jsonl")
    assert result.exit_code == 2 and "does not exist" in result.output
    assert invoke("items", "cut-refeed", "--seed", "x", "--out", there).exit_code == 2
