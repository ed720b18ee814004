"""Issue 49, item 2: a declared schema per experiment. A toy experiment declared without
one is refused, through the registry and the command line; and every forgery the issue
found passing ``kvreplay audit --sample 0`` on a rollout run (manifest and rows rewritten
and rechained as a forger would) is now named, as is a field added inside a panel row's
arm; a manifest whose environment gains a key no run writes is refused by every
command that reads a run folder."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from forgery import assert_named, manifest, read_rows, rechain, write_manifest
from helpers import assert_one_sentence, invoke, write_items

from integration.test_add_experiment import install, kvreplay
from kvreplay.core.canonical import sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.core.registry import Registry
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.table import Table

TOKENS = 6


def test_a_toy_experiment_without_a_schema_is_refused() -> None:
    def toy() -> Declaration:
        return Declaration(
            name="toy", summary="A toy.", experiment="toy:Toy",
            table=Table("toy.csv", (), "toy", lambda rows: iter(()), ()),
        )  # fmt: skip

    registry: Registry[Declaration] = Registry("experiment", lambda: [("toy:DECLARATION", toy())])
    with pytest.raises(KvreplayError, match="declares no schema"):
        registry.names()


def test_a_toy_experiment_without_a_schema_cannot_be_added_through_an_entry_point(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """The tutorial's package (docs/experiments/add.md) with its schema left out."""
    site = tmp_path / "site"
    install(site)
    declared = site / "repeat_experiment" / "__init__.py"
    text = declared.read_text()
    start = text.index("    schema=panel_schema(")
    declared.write_text(text[:start] + ")\n")
    result = kvreplay(site, "run", "repeat", "--model", str(tiny_dirs["qwen2"]),
                      "--out", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert_one_sentence(result.stderr, "The experiment 'repeat' declares no schema")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def rollout_run(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]) -> Path:
    """Two items, two seeds, two turns on the tiny qwen2 in fp32, scored by hf:fp32."""
    root = tmp_path_factory.mktemp("schema")
    items = write_items(root / "items.jsonl", ["What is 2+3?", "Compute 4*5."], "t", "5")
    out = root / "run"
    result = invoke("run", "rollout", "--model", tiny_dirs["qwen2"], "--items", items,
                    "--dtypes", "fp32", "--max-tokens", TOKENS, "--turns", 2, "--samples", 2,
                    "--out", out)  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    return out


@pytest.fixture
def forged(rollout_run: Path, tmp_path: Path) -> Path:
    copy_ = tmp_path / "run"
    shutil.copytree(rollout_run, copy_)
    return copy_


def test_the_honest_rollout_run_passes(rollout_run: Path) -> None:
    result = invoke("audit", rollout_run, "--sample", 0)
    assert result.exit_code == 0, result.output


Config = dict[str, Any]
CONFIG_EDITS: dict[str, tuple[Callable[[Config], None], str]] = {
    "a verdict added": (lambda c: c.__setitem__("verdict", "pass"), "config.verdict"),
    "its scorers replaced": (
        lambda c: c["scorers"][0].update(label="hf:bf16", precision="bf16"),
        "not the config's scorers",
    ),
    "a scorer labelled otherwise": (
        lambda c: c["scorers"][0].update(label="hf:fp16"),
        "is not labelled as its spec",
    ),
    "seeds off the sampling seed": (lambda c: c.__setitem__("seeds", [5, 9]), "seeds"),
    "a sampling flag its rows' inputs do not hold": (
        lambda c: c["sampling"].__setitem__("ignore_eos", True),
        "inputs.sampling is not what",
    ),
    "turns past their bound": (lambda c: c.__setitem__("turns", 10**9), "turns"),
    "top-k past its bound": (
        lambda c: c["sampling"].__setitem__("top_k", 10**9),
        "sampling.top_k is 1000000000",
    ),
    "a temperature no sampler takes": (
        lambda c: c["sampling"].__setitem__("temperature", 1e-300),
        "sampling is not one",
    ),
    "a logprobs mode no run writes": (
        lambda c: c["sampling"].__setitem__("logprobs", "both"),
        "config.sampling.logprobs",
    ),
}


@pytest.mark.parametrize("edit", list(CONFIG_EDITS))
def test_a_rollout_config_a_forger_rehashed_is_named(forged: Path, edit: str) -> None:
    change, needle = CONFIG_EDITS[edit]
    data = manifest(forged)
    entry = data["experiments"]["rollout"]
    change(entry["config"])
    entry["config_sha256"] = sha256_json(entry["config"])
    write_manifest(forged, data)
    assert_named(invoke("audit", forged, "--sample", 0), needle)


Row = dict[str, Any]


def _turn(row: Row, turn: int = 0) -> Row:
    return row["rollouts"][0]["turns"][turn]


def _one_token_more(row: Row) -> None:
    """A first turn one token longer, every list of it and of its scores kept whole."""
    turn = _turn(row)
    for side in (turn, *turn["scores"].values()):
        for key in ("token_ids", "logprobs", "margins"):
            if side.get(key) is not None:
                side[key].append(side[key][-1])


ROW_EDITS: dict[str, tuple[Callable[[Row], None], str]] = {
    "a verdict added": (lambda r: r.__setitem__("verdict", "pass"), "field verdict"),
    "a verdict inside a turn": (lambda r: _turn(r).__setitem__("verdict", "pass"), "verdict"),
    "a scorer never asked for": (
        lambda r: _turn(r)["scores"].__setitem__("hf:bf16", _turn(r)["scores"]["hf:fp32"]),
        "scores names",
    ),
    "the scorer asked for lost": (lambda r: _turn(r)["scores"].pop("hf:fp32"), "scores names"),
    "a temperature the config does not hold": (
        lambda r: r.__setitem__("temperature", 0.5),
        "field temperature",
    ),
    "a seed the config does not hold": (
        lambda r: r["rollouts"][1].__setitem__("seed", 7),
        "rollouts[].seed",
    ),
    "a status no run writes": (lambda r: r.__setitem__("status", "skipped"), "field status"),
    "cached tokens the hf backend cannot have": (
        lambda r: _turn(r).__setitem__("cached_tokens", 5),
        "cached_tokens",
    ),
    "a second turn's cached tokens": (
        lambda r: _turn(r, 1).__setitem__("cached_tokens", _turn(r, 1)["cached_tokens"] + 1),
        "turns[1].cached_tokens",
    ),
    "a miss that reused tokens": (
        lambda r: _turn(r, 1)["controls"]["miss"].__setitem__("cached_tokens", 3),
        "controls.miss",
    ),
    "a turn dropped": (lambda r: r["rollouts"][0]["turns"].pop(), "turns holds"),
    "more tokens than max_tokens": (_one_token_more, "max_tokens"),
    "a follow-up the config does not hold": (
        lambda r: _turn(r, 1).__setitem__("followup_token_ids", [1]),
        "followup_token_ids",
    ),
}


@pytest.mark.parametrize("edit", list(ROW_EDITS))
def test_a_rollout_row_a_forger_rechained_is_named_at_sample_0(forged: Path, edit: str) -> None:
    change, needle = ROW_EDITS[edit]
    rows = read_rows(forged)
    edited = copy.deepcopy(rows)
    change(edited[0]["data"])
    rechain(forged, edited, experiment="rollout", derive_csv=edit != "a status no run writes")
    assert_named(invoke("audit", forged, "--sample", 0), rows[0]["key"], needle)


def test_a_field_added_inside_a_panel_rows_arm_is_named_at_sample_0(run: Path) -> None:
    rows = read_rows(run)
    edited = copy.deepcopy(rows)
    edited[0]["data"]["arms"]["left"]["verdict"] = "pass"
    rechain(run, edited)
    assert_named(invoke("audit", run, "--sample", 0), rows[0]["key"], "arms.left.verdict")


def test_a_row_whose_precision_is_not_its_keys_is_named_at_sample_0(run: Path) -> None:
    rows = read_rows(run)
    edited = copy.deepcopy(rows)
    precisions = {"bf16": "fp32", "fp32": "bf16"}
    edited[0]["data"]["precision"] = precisions[edited[0]["data"]["precision"]]
    rechain(run, edited)
    assert_named(invoke("audit", run, "--sample", 0), rows[0]["key"], "not its key's")


@pytest.mark.parametrize("key", ["PYTHONPATH", "VLLM_PLUGINS", "KVREPLAY_EXTRA"])
def test_an_environment_key_no_run_writes_is_refused_by_every_reader(run: Path, key: str) -> None:
    data = manifest(run)
    data["environment"][key] = "/tmp/elsewhere"
    write_manifest(run, data)
    for command in (["audit", run, "--sample", 0], ["env", run], ["report", run]):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert_one_sentence(result.stderr, f"field environment.{key} is not one a kvreplay run")
    assert json.loads((run / "manifest.json").read_text())["environment"][key]
