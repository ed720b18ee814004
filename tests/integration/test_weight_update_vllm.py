"""A weight update on vLLM in process (issue 51), on a tiny Qwen2 that vLLM's CPU
attention serves: ``kvreplay check --update`` holds on the clean engine (every sync
resets the prefix cache: the request sent after it is a miss, bit for bit) and fails,
naming the stale cache, with the fault that skips the reset after a weight reload
(vllm-update-stale-cache, planted in the engine's own process); the run records the
in-flight term, and its audit re-executes every row. Runs in the vLLM environment
(``-m vllm``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_items

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = ["What is 2+3? Answer with the number and a short explanation of the sum, please.",
           "Compute 4*5 and explain the steps in detail, please."]  # fmt: skip


def kvreplay(*args: object, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process (with a fault planted in it, where named)."""
    head = ["-m", "kvreplay.faults", fault, "--"] if fault else ["-m", "kvreplay"]
    return subprocess.run([sys.executable, *head, *map(str, args)], capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("weight-update")
    items = write_items(root / "items.jsonl", PROMPTS, "u", "5")
    return save_tiny(root / "model", "served_qwen2"), items


def update_check(setup: tuple[Path, Path], out: Path, fault: str | None = None):
    model, items = setup
    return kvreplay("check", "--backend", "vllm", "--model", model, "--items", items, "--n", 2,
                    "--dtypes", "bf16", "--update", "perturb:0.05:1", "--out", out,
                    "--json", out.with_suffix(".json"), fault=fault)  # fmt: skip


def test_a_correct_sync_holds_and_the_run_audits(setup, tmp_path: Path) -> None:
    out = tmp_path / "clean"
    done = update_check(setup, out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("HOLDS (no stale prefix cache after a weight sync)")
    verdict = json.loads(out.with_suffix(".json").read_text())
    assert verdict["schema"] == "kvreplay-update-v1" and verdict["stale"] == 0
    rows = [json.loads(x)["data"] for x in (out / "rows.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["after"]["cached_tokens"] == 0 and row["after"] == row["miss"]
        at = row["update_at"]
        # before the update the in-flight rollout is the `before` rollout, token for token
        assert row["inflight"]["token_ids"][:at] == row["before"]["token_ids"][:at]
        assert row["inflight"]["logprobs"][:at] == row["before"]["logprobs"][:at]
    analyzed = kvreplay("analyze", out)
    assert analyzed.returncode == 0, analyzed.stderr[-2000:]
    claims = json.loads((out / "claims.json").read_text())["weight_update"]["bf16"]
    assert claims["inflight"]["tokens"] > 0 and claims["engine"]["tokens"] > 0
    audit = kvreplay("audit", out)
    assert audit.returncode == 0 and "PASS" in audit.stdout, audit.stdout[-3000:]


def test_a_sync_that_forgets_the_reset_is_caught(setup, tmp_path: Path) -> None:
    out = tmp_path / "stale"
    done = update_check(setup, out, fault="vllm-update-stale-cache")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("FAILS (no stale prefix cache after a weight sync)")
    assert "STALE CACHE" in done.stdout and "cached tokens" in done.stdout
    verdict = json.loads(out.with_suffix(".json").read_text())
    assert verdict["stale"] == 2


def test_a_trainer_at_the_new_weights_gives_the_cross_term(setup, tmp_path: Path) -> None:
    """--scorers: a trainer loads the run's model as trainers do, moved to the new weights;
    its floats are a plain transformers forward of that model, and the in-flight and
    cross terms add up to its total."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvreplay.model.update import WeightUpdate

    model, items = setup
    out = tmp_path / "run"
    done = kvreplay("run", "weight-update", "--backend", "vllm", "--model", model, "--items", items,
                    "--n", 1, "--dtypes", "bf16", "--update", "perturb:0.05:1", "--scorers",
                    "hf:bf16", "--out", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(x)["data"] for x in (out / "rows.jsonl").read_text().splitlines()]
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    WeightUpdate.parse("perturb:0.05:1").apply(plain, model)
    ids = row["prompt_token_ids"] + row["inflight"]["token_ids"]
    with torch.inference_mode():
        logits = plain(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    start = len(row["prompt_token_ids"]) - 1
    tokens = row["inflight"]["token_ids"]
    expected = [float(logits[start + i, t]) for i, t in enumerate(tokens)]
    assert row["inflight_scores"]["hf:bf16"]["logprobs"] == expected
    assert kvreplay("analyze", out).returncode == 0
    cross = json.loads((out / "claims.json").read_text())["weight_update"]["bf16"]["cross"]
    d = cross["hf:bf16"]
    inflight, term = d["terms"]["inflight"]["mean"], d["terms"]["cross"]["mean"]
    assert inflight + term == pytest.approx(d["total"]["mean"], abs=1e-12)
