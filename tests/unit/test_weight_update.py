"""The weights of a weight update (issue 51): the spec, the perturbation (a function of
the model and the spec: the same tensors twice, a trainer's model moved to them), and
what weight-update and ``check --update`` refuse before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import check, invoke, write_items
from transformers import AutoModelForCausalLM

from kvreplay.core.errors import KvreplayError
from kvreplay.model.update import WeightUpdate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("perturb:0.01", WeightUpdate("perturb:0.01", scale=0.01)),
        ("perturb:0.5:7", WeightUpdate("perturb:0.5:7", scale=0.5, seed=7)),
    ],
)
def test_a_perturbation_is_parsed(text: str, expected: WeightUpdate) -> None:
    assert WeightUpdate.parse(text) == expected


@pytest.mark.parametrize("text", ["perturb:0", "perturb:2", "perturb:x", "perturb:0.1:-1",
                                  "perturb:0.1:1:2", "/no/such/folder"])  # fmt: skip
def test_a_bad_update_is_refused(text: str) -> None:
    with pytest.raises(KvreplayError, match="--update"):
        WeightUpdate.parse(text)


def test_the_perturbation_is_a_function_of_the_model_and_the_spec(tiny_dirs) -> None:
    folder = tiny_dirs["qwen2"]
    update = WeightUpdate.parse("perturb:0.01:3")
    first, again = dict(update.tensors(folder)), dict(update.tensors(folder))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = dict(WeightUpdate.parse("perturb:0.01:4").tensors(folder))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(first[name], other[name])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    before = model.get_parameter(name).clone()
    update.apply(model, folder)
    moved = model.get_parameter(name)
    assert torch.equal(moved, first[name]) and not torch.equal(moved, before)
    relative = float((moved - before).std() / before.std())
    assert 0.005 < relative < 0.02  # a hundredth of each tensor's spread


def test_a_server_reloads_the_same_weights_from_a_folder(tiny_dirs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    update = WeightUpdate.parse("perturb:0.01:3")
    written = load_file(str(update.write(tiny_dirs["qwen2"], tmp_path / "w") / "model.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in update.tensors(tiny_dirs["qwen2"]))


def test_an_engine_that_cannot_update_its_weights_is_refused(tmp_path: Path, tiny_dirs) -> None:
    items = write_items(tmp_path / "items.jsonl", ["What is 2+3?"], "t", "5")
    out = tmp_path / "out"
    result = invoke("run", "weight-update", "--model", tiny_dirs["qwen2"], "--items", items,
                    "--update", "perturb:0.01", "--out", out)  # fmt: skip
    check(result, "The hf backend cannot update its weights mid-run", out)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--update", "perturb:0.01", "--trainer", "hf:fp32"), "ask for two checks"),
        (("--update", "perturb:0.01", "--expect", "bitwise"), "does not apply to --update"),
        (("--update", "perturb:3"), "--update perturb:3: write perturb:SCALE"),
        (("--update-at", "3"), "--update-at applies to a --update check"),
        (("--update", "perturb:0.01", "--max-k3-kl", "0.1"), "does not apply to a --update"),
    ],
)
def test_what_an_update_check_refuses(tmp_path: Path, extra: tuple, expected: str) -> None:
    out = tmp_path / "check"
    check(invoke("check", "--out", out, *extra), expected, out)


def test_the_declared_schema_names_a_row_its_config_contradicts() -> None:
    """weight-update's declared schema (what the audit checks at --sample 0): a row as a
    run writes it passes; an update point, trainers or an in-flight part the config did
    not plan, a field no run writes, and an update its spec does not name are named."""
    from kvreplay.core.rollout import Sampling, Scored, Turn
    from kvreplay.experiments.weight_update.schema import SCHEMA

    update = {**WeightUpdate.parse("perturb:0.01:3").to_dict(), "model_digest": None}
    trainer = {"label": "hf:bf16", "backend": "hf", "precision": "bf16", "schedule": "prefill",
               "model": None, "model_digest": "d", "load": "pretrained"}  # fmt: skip
    config = {"item_ids": ["a"], "dtypes": ["bf16"], "update": update, "update_at": 4,
              "sampling": Sampling(max_tokens=8, ignore_eos=True).to_dict(),
              "scorers": [trainer]}  # fmt: skip
    turn = Turn([1, 2, 3], [-0.1, -0.2, -0.3], None, 0).to_dict()
    scored = Scored([-0.1, -0.2, -0.3]).to_dict()
    row = {"item_id": "a", "precision": "bf16", "status": "ok", "temperature": 1.0,
           "prompt_token_ids": [5, 6], "update_at": 4, "before": turn, "after": turn,
           "miss": turn, "miss_prefill": scored, "inflight": turn, "inflight_prefill": scored,
           "inflight_scores": {"hf:bf16": scored}}  # fmt: skip
    assert SCHEMA.config_problems(config, "config", "version") == []
    assert SCHEMA.row_problems(row, config, None) == []
    forged = {**row, "update_at": 3, "inflight_scores": {"hf:fp32": scored}}
    assert SCHEMA.row_problems(forged, config, None) == [
        "field update_at is 3, not the config's",
        "field inflight_scores names ['hf:fp32'], not the config's trainers ['hf:bf16']",
    ]
    partial = {k: v for k, v in row.items() if k != "inflight_prefill"}
    assert "go together" in SCHEMA.row_problems(partial, config, None)[0]
    assert SCHEMA.row_problems({**row, "verdict": "pass"}, config, None) == [
        "field verdict is not a field a run writes"
    ]
    moved = {**config, "update": {**update, "scale": 0.5}}
    assert SCHEMA.config_problems(moved, "config", "version") == [
        "config update is not the perturbation its spec names"
    ]
