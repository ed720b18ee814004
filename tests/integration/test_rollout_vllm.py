"""The rollout experiment (issue 44) with vLLM in process as the rollout stack, on a tiny
Qwen2 that vLLM's CPU attention serves: two turns (the second a prefix-cache hit over
blocks the first turn's decode wrote, the miss beside it), a batch of other items, the
engine's own prefill and forced replay, transformers as the trainer; audit. And the
numbers checked independently: a plain transformers forward and plain vLLM calls give
the very floats the run recorded. Runs in the vLLM environment (``-m vllm``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_items

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TOKENS = 40
BLOCK = 32  # the vllm backend's default --block-size
PROMPTS = ["What is 2+3?", "Compute 4*5.", "Name three colours."]


def kvreplay(*args: object) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process, so that its engine is gone when it returns."""
    return subprocess.run(
        [sys.executable, "-m", "kvreplay", *map(str, args)], capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("vllm-rollout") / "model", "served_qwen2")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    root = tmp_path_factory.mktemp("vllm-rollout-run")
    items = write_items(root / "items.jsonl", PROMPTS, "v", "5")
    out = root / "run"
    done = kvreplay(
        "run", "rollout", "--backend", "vllm", "--model", model, "--items", items, "--n", 2,
        "--dtypes", "bf16", "--max-tokens", TOKENS, "--ignore-eos", "--turns", 2,
        "--scorers", "hf:bf16,engine:replay", "--out", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(x)["data"] for x in (run / "rows.jsonl").read_text().splitlines()]


def test_turns_hit_the_cache_their_decode_wrote(run: Path) -> None:
    for row in rows(run):
        (rollout,) = row["rollouts"]
        first, second = rollout["turns"]
        assert len(first["token_ids"]) == len(second["token_ids"]) == TOKENS
        computed = len(row["prompt_token_ids"]) + TOKENS - 1  # the last token is never fed
        assert second["cached_tokens"] == computed // BLOCK * BLOCK > len(row["prompt_token_ids"])
        assert second["controls"]["miss"]["cached_tokens"] == 0
        assert first["cached_tokens"] == 0
        batched = first["controls"]["batched"]  # with the other item beside it
        assert batched["cached_tokens"] == 0 and len(batched["token_ids"]) == TOKENS
        assert set(first["scores"]) == {"engine", "engine:replay", "hf:bf16"}
        # the engine's forced replay repeats its own decode bit for bit
        assert first["scores"]["engine:replay"]["logprobs"] == first["logprobs"]


def test_audit_reexecutes_every_row(run: Path) -> None:
    done = kvreplay("audit", run)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "PASS" in done.stdout


def test_plain_calls_give_the_recorded_floats(
    run: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The independent check: the first turn's sampled tokens and their log-probabilities
    from plain vLLM calls (an engine started with vLLM's own defaults for logprobs, without
    kvreplay's logits processor), the engine's prompt log-probabilities, and the trainer's
    from a plain transformers forward, equal the run's bit for bit."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    recorded = rows(run)
    llm = LLM(
        model=str(model), dtype="bfloat16", block_size=BLOCK, enable_prefix_caching=True,
        max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=8192, enforce_eager=True,
        seed=0, distributed_executor_backend="uni",
    )  # fmt: skip
    # the trainer loads bf16 as a trainer does: from_pretrained(dtype) alone, which keeps
    # the rotary inv_freq buffer in fp32 (--trainer-load cast would cast it too)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    for row in recorded:
        prompt = row["prompt_token_ids"]
        turn = row["rollouts"][0]["turns"][0]
        llm.reset_prefix_cache()
        sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=TOKENS, ignore_eos=True,
                                 logprobs=0)  # fmt: skip
        out = llm.generate([{"prompt_token_ids": prompt}], sampled, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == turn["token_ids"]
        steps = zip(out.logprobs, out.token_ids, strict=True)
        assert [step[t].logprob for step, t in steps] == turn["logprobs"]
        ids = prompt + turn["token_ids"]
        scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        prefill = llm.generate([{"prompt_token_ids": ids}], scored, use_tqdm=False)[0]
        positions = enumerate(turn["token_ids"], start=len(prompt))
        engine = [prefill.prompt_logprobs[i][t].logprob for i, t in positions]
        assert engine == turn["scores"]["engine"]["logprobs"]
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        trainer = [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(turn["token_ids"])]
        assert trainer == turn["scores"]["hf:bf16"]["logprobs"]


def test_processed_log_probabilities_are_refused(tmp_path: Path, model: Path) -> None:
    """vLLM's engine here reports raw log-probabilities; at temperature 0.7 a processed
    one would be another number, so asking for it is ambiguous."""
    out = tmp_path / "out"
    done = kvreplay("run", "rollout", "--backend", "vllm", "--model", model, "--n", 1,
                    "--temperature", 0.7, "--logprobs", "processed", "--out", out)  # fmt: skip
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]  # vLLM may log while its config is checked
    assert last.startswith("kvreplay: error: The rollout stack vllm reports raw log-probabilities")
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_a_trainer_check_keeps_vllms_log_off_the_terminal(tmp_path: Path, model: Path) -> None:
    """Issue 49: vLLM's own log goes to the check's engine.log, as a live vs prefill
    check's does; the terminal shows the verdict."""
    items = write_items(tmp_path / "items.jsonl", PROMPTS[:1], "v", "5")
    out = tmp_path / "check"
    done = kvreplay(
        "check", "--backend", "vllm", "--trainer", "hf:bf16", "--model", model, "--items",
        items, "--n", 1, "--dtypes", "bf16", "--max-tokens", 8, "--max-k3-kl", 1, "--out", out,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-3000:]
    logged = (out / "engine.log").read_text(errors="replace").splitlines()
    # vLLM starting its engine (at the level the rollout stack leaves it: INFO or WARNING)
    engine = [line for line in logged if "INFO" in line or "WARNING" in line][:8]
    assert engine, logged[:20]
    shown = done.stdout + done.stderr
    assert not [line for line in engine if line in shown], shown[-3000:]
