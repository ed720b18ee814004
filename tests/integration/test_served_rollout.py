"""A running ``vllm serve`` as a rollout stack, a scorer and an engine whose weights a run
updates (issue 51), on a tiny Qwen2 in bf16: the rollout run's first turn is what a plain
``/v1/completions`` request returns, token for token and float for float, and the
server's own prefill is its ``prompt_logprobs``; ``check --update`` holds on the clean
server and fails, naming the stale cache, on a server whose weight sync skips the reset
(the fault planted through kvreplay's vLLM plugin). One server per case."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import invoke, vllm_server, write_items
from tiny import save_tiny

from kvreplay.faults.plugin import write_plugin_folder
from kvreplay.faults.registry import ENV

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 24
PROMPTS = ["What is 2+3? Answer with the number and a short explanation of the sum, please.",
           "Compute 4*5 and explain the steps in detail, please."]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("served-rollout")
    items = write_items(root / "items.jsonl", PROMPTS, "s", "5")
    return save_tiny(root / "model", "served_qwen2"), items


@contextmanager
def serve(model: Path, folder: Path, fault: str | None = None) -> Iterator[str]:
    path = [str(write_plugin_folder(folder / "plugin")), os.environ.get("PYTHONPATH", "")]
    # A default vllm serve: its workers in processes of their own (this process may have
    # set the in-process engine's VLLM_ENABLE_V1_MULTIPROCESSING=0, which is not passed on).
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), ENV: fault,
           "VLLM_ENABLE_V1_MULTIPROCESSING": None}  # fmt: skip
    flags = ("--dtype", "bfloat16", "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--block-size", "32", "--max-model-len", "1024")  # fmt: skip
    with vllm_server(model, folder / "vllm.log", *flags, env=env) as url:
        yield url


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def update_check(url: str, setup: tuple[Path, Path], out: Path):
    model, items = setup
    return invoke("check", "--backend", "http", "--url", url, "--model", model, "--items", items,
                  "--n", 2, "--dtypes", "bf16", "--update", "perturb:0.05:1", "--out", out,
                  "--json", out.with_suffix(".json"))  # fmt: skip


def test_a_server_samples_scores_and_updates_its_weights(setup, tmp_path: Path) -> None:
    model, items = setup
    out = tmp_path / "rollout"
    with serve(model, tmp_path) as url:
        result = invoke("run", "rollout", "--backend", "http", "--url", url, "--model", model,
                        "--items", items, "--n", 1, "--dtypes", "bf16", "--max-tokens", TOKENS,
                        "--ignore-eos", "--scorers", "hf:bf16", "--out", out)  # fmt: skip
        assert result.exit_code == 0, (result.output, result.exception)
        (row,) = [json.loads(x)["data"] for x in (out / "rows.jsonl").read_text().splitlines()]
        turn = row["rollouts"][0]["turns"][0]
        prompt = row["prompt_token_ids"]
        # the independent check: plain requests to the same server
        plain = post(url, {"model": str(model), "prompt": prompt, "max_tokens": TOKENS,
                           "temperature": 1.0, "seed": 0, "logprobs": 1, "ignore_eos": True,
                           "return_token_ids": True})["choices"][0]  # fmt: skip
        assert plain["token_ids"] == turn["token_ids"]
        assert plain["logprobs"]["token_logprobs"] == turn["logprobs"]
        scored = post(url, {"model": str(model), "prompt": prompt + turn["token_ids"],
                            "max_tokens": 1, "temperature": 0,
                            "prompt_logprobs": 1})["choices"][0]["prompt_logprobs"]  # fmt: skip
        expected = [scored[len(prompt) + i][str(t)]["logprob"]
                    for i, t in enumerate(turn["token_ids"])]  # fmt: skip
        assert turn["scores"]["engine"]["logprobs"] == expected
        held = update_check(url, setup, tmp_path / "update")
    assert held.exit_code == 0, held.output
    assert held.output.startswith("HOLDS (no stale prefix cache after a weight sync)")
    assert invoke("analyze", out).exit_code == 0


def test_a_server_whose_sync_forgets_the_reset_is_caught(setup, tmp_path: Path) -> None:
    with serve(setup[0], tmp_path, "vllm-update-stale-cache") as url:
        failed = update_check(url, setup, tmp_path / "update")
    assert failed.exit_code == 1, failed.output
    assert "STALE CACHE" in failed.output
    assert json.loads((tmp_path / "update.json").read_text())["stale"] == 2
