"""Logged rollouts as RL frameworks write them (issue 51): a tiny Qwen2 samples in bf16,
token by token over its own cache (the rollout side), and the same model in fp32 scores
the sequences in one forward (the trainer side), all in plain transformers; plain
framework-shaped code writes prime-rl's token export, NeMo-RL's training data, a verl
batch and a TRL batch (through the recipe docs/experiments/rollout.md gives), never
kvreplay. ``kvreplay mismatch`` reads each, and its numbers are the frameworks' own
formulas, written here independently, over the tokens their masks keep. And what an RL
team's own data holds: padding, steps whose mismatch grows, rounded log-probabilities,
two sides of different distributions, ids of another tokenizer, pickles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import check, invoke, jsonl
from transformers import AutoModelForCausalLM

DOCS = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "rollout.md"
PROMPTS = [[60, 61, 62, 63], [70, 71, 72, 73, 74, 75, 76], [80, 81]]
LENGTHS = [24, 17, 30]
PAD = 256  # the tiny tokenizer's pad (and eos) id


@pytest.fixture(scope="module")
def sampled(tiny_dirs) -> list[dict]:
    """Per prompt: the response a bf16 model sampled token by token over its cache, the
    log-probability it gave each token it took, and an fp32 trainer's log-probability of
    every token of the whole sequence from one forward (position i: log p(token i | the
    tokens before it); position 0 from zero logits, as prime-rl pads its first logit)."""
    folder = tiny_dirs["qwen2"]
    sampler = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    found = []
    with torch.inference_mode():
        for prompt, length in zip(PROMPTS, LENGTHS, strict=True):
            out = sampler(torch.tensor([prompt]), use_cache=True)
            tokens, logprobs = [], []
            for _ in range(length):
                step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.multinomial(step.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(step[token]))
                out = sampler(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
            ids = torch.tensor([prompt + tokens])
            logits = trainer(ids).logits[0].float()
            shifted = torch.cat([torch.zeros_like(logits[:1]), logits[:-1]])
            every = torch.log_softmax(shifted, dim=-1).gather(1, ids[0][:, None])[:, 0]
            found.append({"prompt": prompt, "tokens": tokens,
                          "rollout": torch.tensor(logprobs, dtype=torch.float32),
                          "trainer": every.to(torch.float32)})  # fmt: skip
    return found


def claims_of(path: Path, tmp_path: Path, *extra: object) -> dict:
    out = tmp_path / "claims.json"
    result = invoke("mismatch", path, "--json", out, *extra)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(out.read_text())["logged"]


def k3(trainer: np.ndarray, rollout: np.ndarray) -> np.ndarray:
    log_ratio = trainer - rollout
    return np.exp(log_ratio) - log_ratio - 1


def test_prime_rl_token_export(sampled, tmp_path: Path) -> None:
    """token_exports/step_N/rank_R.jsonl as prime-rl's TokenExporter writes a line:
    the whole sequence, its loss mask, both sides aligned to the tokens (the prompt's
    inference log-probabilities 0, non-finite values null), floats through float32."""
    root = tmp_path / "run" / "token_exports"
    expected_k3, expected_tokens = [], 0
    for step in (0, 1):
        for rank in (0, 1):
            lines = []
            for index, s in enumerate(sampled):
                n, p = len(s["tokens"]), len(s["prompt"])
                inference = [0.0] * p + s["rollout"].tolist()
                trainer = s["trainer"].tolist()
                trainer[0] = None  # as _json_float writes a value that is not finite
                mask = [False] * p + [True] * n
                lines.append(json.dumps({
                    "schema_version": 1, "step": step, "export_step": step, "rank": rank,
                    "micro_step": 0, "micro_sequence_idx": index, "export_sequence_idx": index,
                    "run_id": None, "env_name": "arith", "token_ids": s["prompt"] + s["tokens"],
                    "position_ids": list(range(n + p)), "loss_mask": mask,
                    "advantages": [0.5] * (n + p), "inference_logprobs": inference,
                    "trainer_logprobs": trainer, "entropy": [1.0] * (n + p),
                    "mismatch_kl": [None] * (n + p),
                }, separators=(",", ":")))  # fmt: skip
                kept = np.array(mask)
                t = np.array([np.nan if v is None else v for v in trainer])[kept]
                expected_k3 += k3(t, np.array(inference)[kept]).tolist()
                expected_tokens += int(kept.sum())
            folder = root / f"step_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            jsonl(folder / f"rank_{rank}.jsonl", lines)
    found = claims_of(tmp_path / "run", tmp_path)
    metrics = found["scorers"]["trainer"]["metrics"]
    # prime-rl's mismatch_kl: exp(log ratio) - log ratio - 1, over the loss mask
    assert metrics["tokens"] == expected_tokens
    assert metrics["kl_k3"] == pytest.approx(np.mean(expected_k3), rel=1e-12)
    steps = found["steps"]["trainer"]["by_step"]
    assert [s["step"] for s in steps] == [0, 1] and steps[0]["sequences"] == 2 * len(sampled)
    assert set(found["environments"]["trainer"]) == {"arith"}


def test_nemo_rl_training_data(sampled, tmp_path: Path) -> None:
    """train_data_stepN.jsonl as NeMo-RL's logger writes it: the batch padded to its
    longest sequence, masks per token and per sample, both sides aligned to the tokens;
    kvreplay's token_mult_prob_error is NeMo-RL's masked mean of exp(|error| * mask)."""
    width = max(len(s["prompt"]) + len(s["tokens"]) for s in sampled)
    lines, generation, previous, masks = [], [], [], []
    for index, s in enumerate(sampled):
        n, p = len(s["tokens"]), len(s["prompt"])
        pad = width - n - p
        ids = s["prompt"] + s["tokens"] + [PAD] * pad
        gen = [0.0] * p + s["rollout"].tolist() + [0.0] * pad
        prev = s["trainer"].tolist()[: n + p] + [-3.0] * pad
        prev[0] = 0.0
        token_mask = [0.0] * p + [1.0] * n + [0.0] * pad
        sample_mask = 0.0 if index == 1 else 1.0  # a sample NeMo-RL leaves out
        lines.append(json.dumps({
            "content": ["..."], "rewards": 1.0, "input_lengths": n + p, "token_ids": ids,
            "token_loss_mask": token_mask, "sample_loss_mask": sample_mask,
            "advantages": [0.1] * width, "generation_logprobs": gen,
            "prev_logprobs": prev, "idx": index,
        }))  # fmt: skip
        generation.append(gen)
        previous.append(prev)
        masks.append(np.array(token_mask) * sample_mask)
    path = jsonl(tmp_path / "train_data_step3.jsonl", lines)
    found = claims_of(path, tmp_path)
    g, p, mask = np.array(generation), np.array(previous), np.array(masks)
    expected = float((np.exp(np.abs(g - p) * mask) * mask).sum() / mask.sum())
    metrics = found["scorers"]["trainer"]["metrics"]
    assert metrics["token_mult_prob_error"] == pytest.approx(expected, rel=1e-12)
    assert metrics["sequences"] == 2 and metrics["tokens"] == mask.sum()
    assert found["steps"]["trainer"]["by_step"][0]["step"] == 3


def recipes() -> dict:
    """The recipe block of docs/experiments/rollout.md, run as written."""
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"<!-- recipe: frameworks -->\n```python\n(.*?)```", text, re.S)
    assert match is not None
    found: dict = {}
    exec(match.group(1), found)  # noqa: S102 - the repository's own documentation
    return found


def padded(rows: list[list], value: float, width: int, left: bool = False) -> torch.Tensor:
    pad = [[value] * (width - len(r)) for r in rows]
    return torch.tensor([p + r if left else r + p for r, p in zip(rows, pad, strict=True)])


def test_a_verl_batch_through_the_recipe_gives_the_unpadded_numbers(
    sampled, tmp_path: Path
) -> None:
    """A verl batch: prompts padded on the left, responses on the right with the pad id
    and log-probabilities of 0 on both sides; through the recipe, kvreplay's numbers are
    verl's formulas over response_mask, and those of the unpadded tokens; without the
    mask, padding reads as perfectly matched tokens and moves them."""
    width_p = max(len(s["prompt"]) for s in sampled)
    width_r = max(len(s["tokens"]) for s in sampled)
    prompts = padded([s["prompt"] for s in sampled], PAD, width_p, left=True)
    attention_p = padded([[1] * len(s["prompt"]) for s in sampled], 0, width_p, left=True)
    responses = padded([s["tokens"] for s in sampled], PAD, width_r)
    response_mask = padded([[1] * len(s["tokens"]) for s in sampled], 0, width_r)
    rollout = padded([s["rollout"].tolist() for s in sampled], 0.0, width_r).float()
    trainer_rows = [s["trainer"][len(s["prompt"]) :].tolist() for s in sampled]
    old = padded(trainer_rows, 0.0, width_r).float()
    batch = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "attention_mask": torch.cat([attention_p, response_mask], dim=1),
        "rollout_log_probs": rollout, "old_log_probs": old,
    }  # fmt: skip
    path = tmp_path / "verl.jsonl"
    recipes()["write_verl_rollouts"](batch, 5, path, 1.0)
    found = claims_of(path, tmp_path)["scorers"]["trainer"]["metrics"]
    mask = response_mask.double().numpy()
    log_ratio = (old - rollout).double().numpy()
    verl_k3 = (k3(old.double().numpy(), rollout.double().numpy()) * mask).sum() / mask.sum()
    assert found["kl_k3"] == pytest.approx(verl_k3, rel=1e-12)
    unpadded = np.concatenate([k3(np.array(t), s["rollout"].double().numpy())
                               for t, s in zip(trainer_rows, sampled, strict=True)])  # fmt: skip
    assert found["kl_k3"] == pytest.approx(unpadded.mean(), rel=1e-12)
    sums = (log_ratio * mask).sum(axis=1)  # verl: masked_sum of the log ratio
    assert found["chi2_seq"] == pytest.approx(np.mean(np.exp(2 * np.clip(sums, -20, 20))) - 1)
    assert found["seq_truncated_verl"] == np.count_nonzero(sums > np.log(2.0))
    unmasked = tmp_path / "unmasked.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    jsonl(unmasked, [json.dumps({k: v for k, v in x.items() if k != "mask"}) for x in lines])
    wrong = claims_of(unmasked, tmp_path)["scorers"]["trainer"]["metrics"]
    assert wrong["kl_k3"] < found["kl_k3"]  # the pads' zero deltas dilute it


def test_a_trl_batch_through_the_recipe(sampled, tmp_path: Path) -> None:
    """A TRL GRPO batch: kvreplay's count of sequences TRL's default correction masks is
    TRL's sequence_mask rule (the ratio of the masked sum above 3)."""
    width_p = max(len(s["prompt"]) for s in sampled)
    width_r = max(len(s["tokens"]) for s in sampled)
    completion_mask = padded([[1] * len(s["tokens"]) for s in sampled], 0, width_r)
    sampling = padded([s["rollout"].tolist() for s in sampled], 0.0, width_r).float()
    old = padded([s["trainer"][len(s["prompt"]) :].tolist() for s in sampled], 0.0, width_r)
    tool_mask = torch.ones_like(completion_mask)
    tool_mask[0, 3:6] = 0  # tool output inside the first completion
    path = tmp_path / "trl.jsonl"
    recipes()["write_trl_rollouts"](
        padded([s["prompt"] for s in sampled], PAD, width_p, left=True),
        padded([[1] * len(s["prompt"]) for s in sampled], 0, width_p, left=True),
        padded([s["tokens"] for s in sampled], PAD, width_r), completion_mask,
        sampling, old.float(), 2, path, 1.0, tool_mask,
    )  # fmt: skip
    found = claims_of(path, tmp_path)["scorers"]["trainer"]["metrics"]
    mask = (completion_mask * tool_mask).double().numpy()
    diff = ((old.float() - sampling).double().numpy()) * mask
    ratio = np.exp(diff.sum(axis=1, keepdims=True))  # TRL: per_sequence_logps_diff
    assert found["seq_masked_trl"] == np.count_nonzero(ratio > 3.0)
    assert found["tokens"] == mask.sum()
    assert found["abs_logp_mean"] == pytest.approx(np.abs(diff).sum() / mask.sum(), rel=1e-12)


def logged_line(index: int, delta: float, step: int, extra: dict | None = None, n: int = 40) -> str:
    rng = np.random.default_rng(index)
    rollout = (-rng.exponential(0.7, n)).astype(np.float32)
    trainer = np.minimum(rollout + rng.normal(0, delta, n).astype(np.float32), 0)
    return json.dumps({
        "id": f"s{index}", "prompt_ids": [1, 2], "response_ids": rng.integers(3, 200, n).tolist(),
        "rollout_logprobs": rollout.astype(float).tolist(),
        "trainer_logprobs": trainer.astype(np.float32).astype(float).tolist(), "step": step,
    } | (extra or {}))  # fmt: skip


def test_a_mismatch_that_grows_step_over_step_raises_the_alarm(tmp_path: Path) -> None:
    """The stale-cache pattern: after each weight sync the mismatch grows; the trend's
    alarm fires, and --fail-on-growth turns it into exit 1 naming it; steady steps pass."""
    growing = [logged_line(i, 0.01 * (1 + i // 4), i // 4) for i in range(24)]
    path = jsonl(tmp_path / "growing.jsonl", growing)
    result = invoke("mismatch", path, "--fail-on-growth")
    assert result.exit_code == 1, result.output
    assert "ALARM: the mismatch grows step over step" in result.output
    assert "the k3 KL grows step over step (logged)" in result.output
    steady = jsonl(tmp_path / "steady.jsonl", [logged_line(i, 0.02, i // 4) for i in range(24)])
    assert invoke("mismatch", steady, "--fail-on-growth").exit_code == 0


def test_a_32768_token_response_and_rounded_log_probabilities(tmp_path: Path) -> None:
    """A long chain of thought is one line of a few megabytes (no field limit); rounded
    log-probabilities (not float32) are compared as they are, and the decomposition adds
    up within its stated tolerance: numbers, no traceback."""
    rng = np.random.default_rng(9)
    n = 32768
    rollout = np.round(-rng.exponential(0.7, n), 4)
    line = {
        "id": "long", "prompt_ids": [1], "response_ids": rng.integers(3, 200, n).tolist(),
        "rollout_logprobs": rollout.tolist(),
        "engine_logprobs": np.round(np.minimum(rollout + rng.normal(0, 0.02, n), 0), 4).tolist(),
        "trainer_logprobs": np.round(np.minimum(rollout + rng.normal(0, 0.03, n), 0), 4).tolist(),
    }  # fmt: skip
    found = claims_of(jsonl(tmp_path / "long.jsonl", [json.dumps(line)]), tmp_path)
    assert found["scorers"]["trainer"]["metrics"]["tokens"] == n
    assert found["decomposition"]["trainer"]["exact"] is False


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"rollout_logprobs_mode": "processed", "rollout_temperature": 0.7,
          "trainer_logprobs_mode": "raw"},
         "its rollout side holds processed log-probabilities at temperature 0.7 and its "
         "trainer side raw log-probabilities: those are of different distributions"),
        ({"rollout_logprobs_mode": "processed", "rollout_temperature": 0.7,
          "trainer_logprobs_mode": "processed", "trainer_temperature": 1.0},
         "its rollout side holds processed log-probabilities at temperature 0.7 and its "
         "trainer side processed log-probabilities at temperature 1"),
        ({"mask": [0] * 40}, "its mask keeps no token"),
        ({"mask": [2] * 40}, "its 'mask' is not a list of one 0 or 1 per token"),
        ({"step": -1}, "its 'step' is not a count"),
    ],
)  # fmt: skip
def test_what_cannot_be_compared_is_refused(tmp_path: Path, extra: dict, expected: str) -> None:
    path = jsonl(tmp_path / "l.jsonl", [logged_line(0, 0.02, 0), logged_line(1, 0.02, 0, extra)])
    check(invoke("mismatch", path), f"line 2: {expected}", tmp_path / "none")


def test_the_same_distribution_at_temperature_1_is_compared(tmp_path: Path) -> None:
    extra = {"rollout_logprobs_mode": "processed", "rollout_temperature": 1.0,
             "trainer_logprobs_mode": "raw", "trainer_temperature": 1.0}  # fmt: skip
    path = jsonl(tmp_path / "l.jsonl", [logged_line(0, 0.02, 0, extra)])
    assert claims_of(path, tmp_path)["logprobs"]["rollout"] == [
        {"mode": "processed", "temperature": 1.0}
    ]


def test_a_null_log_probability_where_the_mask_keeps_a_token_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "token_exports" / "step_0"
    folder.mkdir(parents=True)
    line = {
        "schema_version": 1,
        "step": 0,
        "rank": 0,
        "export_sequence_idx": 0,
        "token_ids": [1, 2, 3],
        "loss_mask": [False, True, True],
        "inference_logprobs": [0.0, -0.5, None],
        "trainer_logprobs": [None, -0.4, -0.3],
    }
    jsonl(folder / "rank_0.jsonl", [json.dumps(line)])  # fmt: skip
    result = invoke("mismatch", tmp_path)
    check(result, "its 'inference_logprobs' holds null at token 2", tmp_path / "none")


@pytest.mark.parametrize("kind", ["suffix", "bytes"])
def test_pickled_dumps_are_refused_with_how_to_convert(tmp_path: Path, kind: str) -> None:
    path = tmp_path / ("rollouts.pt" if kind == "suffix" else "rollouts.jsonl")
    path.write_bytes(b"\x80\x04\x95" + b"\x00" * 16)  # a pickle's first bytes
    check(invoke("mismatch", path), "is a pickle (torch.save or pickle.dump)", tmp_path / "none")
    assert "Convert it in your own process" in invoke("mismatch", path).stderr


def test_ids_from_another_tokenizer_are_refused_on_rescoring(tiny_dirs, tmp_path: Path) -> None:
    """Rescored by the model that sampled them, the engine term is a few hundredths of a
    nat; the same log-probabilities over ids that mean other tokens (another tokenizer's
    numbering, still inside the vocabulary) would be rescored into nonsense: refused.
    The tiny model's head is sharpened so that, as in a trained model, the tokens it
    samples are far likelier than others."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    folder = tmp_path / "peaked"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_dirs["qwen2"] / name).read_bytes())
    sampler = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    good, shifted = [], []
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            out, tokens, logprobs = sampler(torch.tensor([prompt])), [], []
            for _ in range(20):
                step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.multinomial(step.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(step[token]))
                out = sampler(torch.tensor([prompt + tokens]))  # plain: the whole sequence
            base = {"id": f"s{i}", "prompt_ids": prompt, "rollout_logprobs": logprobs,
                    "trainer_logprobs": logprobs}  # fmt: skip
            good.append(json.dumps(base | {"response_ids": tokens}))
            other = [(t * 7 + 13) % 250 for t in tokens]
            shifted.append(json.dumps(base | {"response_ids": other}))
    rescore = ("--rescore", "hf:bf16", "--model", folder)
    fine = claims_of(jsonl(tmp_path / "good.jsonl", good), tmp_path, *rescore)
    assert fine["decomposition"]["trainer"]["terms"]["engine"]["abs_mean"] < 0.1
    result = invoke("mismatch", jsonl(tmp_path / "other.jsonl", shifted), *rescore)
    check(result, "its ids are not this model's", tmp_path / "none")
