"""The rollout experiment (issue 44) on the hf backend through the CLI: the files a run
writes, the decomposition's terms, the controls, audit, analyze and report; the mismatch
gate (``kvreplay check --trainer``) passing at the bit level on a bitwise-aligned pair
and failing a bound; bring your own stack (kvreplay's own backends wrapped as callables
give the run's numbers bit for bit) and logged rollouts (``kvreplay mismatch``); and bad
input refused in one sentence."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from helpers import check, invoke, jsonl, write_items
from tiny import DRIFT_CHUNK

from kvreplay.backends.base import Capabilities
from kvreplay.backends.hf import HfBackend
from kvreplay.backends.hf.loading import load_model
from kvreplay.backends.hf.rollout import rollout_stack, scorer
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Conversation, Sampling

PROMPTS = ["What is 2+3?", "Compute 4*5 and explain the steps in detail, please."]
TOKENS = 12


def rollout(out: Path, model: Path, items: Path, *extra: object) -> None:
    result = invoke(
        "run", "rollout", "--model", model, "--items", items, "--max-tokens", TOKENS,
        "--out", out, *extra,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)


def lines(run: Path) -> list[dict[str, str]]:
    with (run / "rollout_logprobs.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def rows(run: Path) -> list[dict]:
    return [json.loads(x)["data"] for x in (run / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_items(tmp_path_factory.mktemp("items") / "items.jsonl", PROMPTS, "t", "5")


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory: pytest.TempPathFactory, tiny_dirs, items: Path) -> Path:
    """Two turns on drift_qwen2 in fp32 (its prefill drifts from decode on every CPU),
    scored by hf fp32 in one prefill and in the live schedule."""
    out = tmp_path_factory.mktemp("rollout") / "run"
    rollout(out, tiny_dirs["drift_qwen2"], items, "--dtypes", "fp32", "--turns", "2",
            "--samples", "2", "--scorers", "hf:fp32,hf:fp32:replay")  # fmt: skip
    return out


def test_a_run_writes_its_ledger_and_one_line_per_side(drift_run: Path) -> None:
    assert {p.name for p in drift_run.iterdir()} >= {"manifest.json", "items.jsonl", "rows.jsonl",
                                                       "rollout_logprobs.csv"}  # fmt: skip
    config = json.loads((drift_run / "manifest.json").read_text())["experiments"]["rollout"]
    assert config["config"]["seeds"] == [0, 1] and config["config"]["turns"] == 2
    assert [s["label"] for s in config["config"]["scorers"]] == ["hf:fp32", "hf:fp32:replay"]
    found = lines(drift_run)
    # 2 items x 2 seeds x 2 turns; sides: rollout, engine, two scorers, and a miss on turn 1
    assert len(found) == 2 * 2 * (2 * 4 + 1)
    sides = {(x["turn"], x["side"]) for x in found}
    assert ("1", "miss") in sides and ("0", "miss") not in sides
    assert not any(x["side"] == "batched" for x in found)  # hf runs no batches


def test_the_terms_are_what_the_stacks_did(drift_run: Path) -> None:
    prompts = {r["item_id"]: len(r["prompt_token_ids"]) for r in rows(drift_run)}
    by = {(x["sequence"], x["side"]): x for x in lines(drift_run)}
    for (sequence, side), line in by.items():
        if side != "rollout":
            continue
        item, _, turn = sequence.split("/")
        decode = json.loads(line["logprobs"])
        engine = json.loads(by[sequence, "engine"]["logprobs"])
        assert json.loads(by[sequence, "hf:fp32"]["logprobs"]) == engine  # cross is exactly 0
        if turn == "0":  # decoded in the live schedule, which replay repeats
            assert json.loads(by[sequence, "hf:fp32:replay"]["logprobs"]) == decode
            assert line["cached_tokens"] == "0"
        else:  # the hit continued turn 0's state; the miss recomputed the whole prompt
            assert int(line["cached_tokens"]) > prompts[item]
            assert by[sequence, "miss"]["cached_tokens"] == "0"
        if turn == "1" or prompts[item] + len(decode) > DRIFT_CHUNK + 1:
            assert engine != decode  # a prefill over more than DRIFT_CHUNK tokens drifts


def test_audit_analyze_and_report(drift_run: Path) -> None:
    result = invoke("audit", drift_run)
    assert result.exit_code == 0, result.output
    assert invoke("analyze", drift_run).exit_code == 0
    claims = json.loads((drift_run / "claims.json").read_text())["rollout_mismatch"]["fp32"]
    d = claims["decomposition"]["hf:fp32"]
    assert d["terms"]["cross"]["tokens_moved"] == 0 and d["terms"]["engine"]["tokens_moved"] > 0
    assert d["dominant"]["term"] == "engine"
    assert claims["controls"]["miss"]["tokens"] > 0
    assert invoke("report", drift_run).exit_code == 0
    assert "Rollout mismatch" in (drift_run / "report.md").read_text()
    assert invoke("audit", drift_run, "--sample", "0").exit_code == 0  # derived files re-derive


def test_a_bitwise_pair_passes_at_the_bit_level(tmp_path: Path, tiny_dirs, items: Path) -> None:
    out, report, junit = tmp_path / "check", tmp_path / "v.json", tmp_path / "v.xml"
    result = invoke(
        "check", "--model", tiny_dirs["qwen2"], "--items", items, "--n", 2, "--dtypes", "fp32",
        "--temperature", 1, "--max-tokens", TOKENS, "--trainer", "hf:fp32:replay",
        "--expect", "bitwise", "--out", out, "--json", report, "--junit", junit,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.startswith("HOLDS bitwise")
    verdict = json.loads(report.read_text())
    assert verdict["schema"] == "kvreplay-mismatch-v1" and verdict["levels"]["bits"]["holds"]
    assert verdict["power"]["rate_upper_95"] == pytest.approx(1 - 0.025 ** (1 / 2))
    assert 'failures="0"' in junit.read_text()
    assert invoke("audit", out).exit_code == 0


def test_a_bound_the_pair_breaks_fails(tmp_path: Path, tiny_dirs, items: Path) -> None:
    report = tmp_path / "v.json"
    result = invoke(
        "check", "--model", tiny_dirs["drift_qwen2"], "--items", items, "--n", 2,
        "--dtypes", "fp32", "--max-tokens", TOKENS, "--trainer", "hf:fp32",
        "--max-abs-logp", 0, "--out", tmp_path / "check", "--json", report,
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    verdict = json.loads(report.read_text())
    assert verdict["levels"]["numbers"]["holds"] is False
    assert verdict["levels"]["bits"]["differ"] >= 1


def test_your_own_callables_give_the_runs_numbers(drift_run: Path, tiny_dirs) -> None:
    """kvreplay's own hf backend wrapped as two callables: the same rollouts and
    log-probabilities as the CLI run, bit for bit, and the same claims."""
    from kvreplay.experiments.rollout import audit_own_stack

    lm = load_model(str(tiny_dirs["drift_qwen2"]), "fp32")
    stack, trainer = rollout_stack(lm), scorer(lm, "prefill")

    def sample(prompt: list[int], sampling: Sampling) -> tuple[list[int], list[float]]:
        turn = stack.sample([Conversation(tuple(prompt), (), sampling)], reuse=True)[0][0]
        return turn.token_ids, turn.logprobs

    recorded = rows(drift_run)
    prompts = [r["prompt_token_ids"] for r in recorded]
    sampling = Sampling(**json.loads((drift_run / "manifest.json").read_text())
                        ["experiments"]["rollout"]["config"]["sampling"])  # fmt: skip

    def score(prompt: list[int], tokens: list[int]) -> list[float]:
        return trainer.score(prompt, tokens).logprobs

    result = audit_own_stack(prompts, sample, score, sampling, engine_score=score, samples=2)
    for own, run in zip(result.rows, recorded, strict=True):
        for mine, theirs in zip(own["rollouts"], run["rollouts"], strict=True):
            first = theirs["turns"][0]
            assert mine["turns"][0]["token_ids"] == first["token_ids"]
            assert mine["turns"][0]["logprobs"] == first["logprobs"]
            assert (
                mine["turns"][0]["scores"]["trainer"]["logprobs"]
                == first["scores"]["hf:fp32"]["logprobs"]
            )
    assert result.verdict.exit_code == 0 and result.verdict.trainer == "trainer"


def test_logged_rollouts_and_the_engines_own_prefill(
    drift_run: Path, tiny_dirs, tmp_path: Path
) -> None:
    logged = []
    for row in rows(drift_run):
        for r in row["rollouts"]:
            turn = r["turns"][0]
            logged.append({
                "id": f"{row['item_id']}-{r['seed']}", "prompt_ids": row["prompt_token_ids"],
                "response_ids": turn["token_ids"], "rollout_logprobs": turn["logprobs"],
                "trainer_logprobs": turn["scores"]["hf:fp32:replay"]["logprobs"],
            })  # fmt: skip
    path = jsonl(tmp_path / "logged.jsonl", [json.dumps(x) for x in logged])
    claims = tmp_path / "claims.json"
    result = invoke("mismatch", path, "--rescore", "hf:fp32", "--model", tiny_dirs["drift_qwen2"],
                    "--json", claims)  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads(claims.read_text())["logged"]
    # the first turns, replayed in the live schedule: no mismatch; the engine's prefill drifts
    assert found["scorers"]["trainer"]["metrics"]["tokens_bit_equal"] == 1
    d = found["decomposition"]["trainer"]["terms"]
    assert d["engine"]["tokens_moved"] > 0
    assert d["engine"]["mean"] == -d["cross"]["mean"]  # they cancel exactly
    gate = invoke("mismatch", path, "--expect", "bitwise")
    assert gate.exit_code == 0 and "HOLDS bitwise" in gate.output


# Bad input: one sentence, exit 2, nothing written that looks like a result.


def bad_run(tmp_path: Path, model: Path, items: Path, *extra: object) -> tuple[object, Path]:
    out = tmp_path / "out"
    args = ["run", "rollout", "--model", model, "--items", items, "--out", out, *extra]
    return invoke(*args), out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--temperature", 0, "--logprobs", "processed"), "point mass"),
        (("--temperature", 0.7, "--top-p", 0.9, "--logprobs", "processed"), "truncation"),
        (("--scorers", "engine"), "always scored"),
        (("--scorers", "hf:fp8"), "not fp8"),
    ],
)
def test_bad_settings_are_refused(
    tmp_path: Path, tiny_dirs, items: Path, extra: tuple, expected: str
) -> None:
    result, out = bad_run(tmp_path, tiny_dirs["qwen2"], items, *extra)
    check(result, expected, out)  # type: ignore[arg-type]
    assert not (out / "manifest.json").exists()


def test_a_scorer_whose_tokenizer_differs_is_refused(
    tmp_path: Path, tiny_dirs, items: Path
) -> None:
    from tiny import byte_tokenizer, save_tiny

    other = save_tiny(tmp_path / "other", "qwen2")
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(other)
    result, out = bad_run(tmp_path, tiny_dirs["qwen2"], items, "--scorers", f"hf:fp32@{other}")
    check(result, "would score other tokens than those sampled", out)  # type: ignore[arg-type]


def test_a_backend_without_log_probabilities_is_refused(
    tmp_path: Path, tiny_dirs, items: Path
) -> None:
    from kvreplay.run.runner import RunRequest, run

    class NoLogprobs(HfBackend):
        capabilities = Capabilities(kv_access=True)

    request = RunRequest(experiment="rollout", out=tmp_path / "out", model=str(tiny_dirs["qwen2"]),
                         items=str(items), dtypes=("fp32",), backend=NoLogprobs())  # fmt: skip
    with pytest.raises(KvreplayError, match="cannot sample with per-token log-probabilities"):
        run(request, quiet=True)
    assert not (tmp_path / "out" / "manifest.json").exists()


GOOD = {"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
        "rollout_logprobs": [-0.1, -0.2, -0.3], "trainer_logprobs": [-0.1, -0.2, -0.4]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"trainer_logprobs": [-0.1, -0.2]}, "its 'trainer_logprobs' holds 2 values for 3"),
        (
            {"rollout_logprobs": [-0.1, 0.5, -0.2]},
            "its 'rollout_logprobs' holds 0.5 at token 1, not a",
        ),
        ({"response_ids": []}, "its 'response_ids' is not a non-empty list of token ids"),
        ({"prompt_ids": None}, "its 'prompt_ids' is not a non-empty list of token ids"),
    ],
)
def test_bad_logged_rollouts_are_refused(tmp_path: Path, change: dict, expected: str) -> None:
    bad = GOOD | {"id": "b"} | change
    path = jsonl(tmp_path / "l.jsonl", [json.dumps(GOOD), json.dumps(bad)])
    check(invoke("mismatch", path), f"line 2: {expected}", tmp_path / "none")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_logged_log_probabilities_are_refused(tmp_path: Path, value: str) -> None:
    line = json.dumps(GOOD).replace("-0.2, -0.3]", f"-0.2, {value}]", 1)
    path = jsonl(tmp_path / "l.jsonl", [line])
    check(invoke("mismatch", path), f"{value} is not a JSON number", tmp_path / "none")


def test_your_own_sampler_returning_nan_is_refused() -> None:
    from kvreplay.experiments.rollout import audit_own_stack

    with pytest.raises(KvreplayError, match="not a finite number at most 0"):
        audit_own_stack([[1, 2]], lambda p, s: ([3], [math.nan]), lambda p, t: [-0.1], Sampling())


@pytest.mark.slow
def test_llamacpp_rollouts_scored_by_transformers(
    tmp_path: Path, smollm2_cache: Path, items: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp (the embedded SmolLM2 GGUF as shipped) samples; its own prefill, its
    live schedule and transformers score; the live schedule repeats its decode exactly."""
    from kvreplay.backends.llamacpp import LlamaCppBackend

    if not LlamaCppBackend().installed():
        pytest.fail("llama.cpp is not built here; run `make setup-llamacpp`.")
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    out = tmp_path / "run"
    result = invoke(
        "run", "rollout", "--backend", "llamacpp", "--dtypes", "fp16", "--items", items,
        "--n", 1, "--max-tokens", 8, "--scorers", "hf:fp32,engine:replay", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    by = {x["side"]: json.loads(x["logprobs"]) for x in lines(out)}
    assert set(by) == {"rollout", "engine", "engine:replay", "hf:fp32"}
    assert by["engine:replay"] == by["rollout"]
    assert invoke("audit", out).exit_code == 0


def test_analyze_reads_a_response_longer_than_a_csv_field(tmp_path: Path) -> None:
    """A rollout CSV line holds a whole response's log-probabilities: one of 9,000 tokens
    (about 190,000 characters, beyond Python's default field limit of 131,072) reads."""
    from kvreplay.experiments.rollout import ROLLOUT_TABLE
    from kvreplay.ledger import Record

    n = 9000
    turn = {"token_ids": [7] * n, "logprobs": [-0.12345678901234] * n, "margins": None,
            "cached_tokens": 0, "finish": "length",
            "scores": {"hf:fp32": {"logprobs": [-0.12345678901233] * n, "margins": None,
                                   "argmax_differs": None}}}  # fmt: skip
    row = {"item_id": "long", "precision": "fp32", "status": "ok", "temperature": 1.0,
           "prompt_token_ids": [1, 2], "rollouts": [{"seed": 0, "turns": [turn]}]}  # fmt: skip
    record = Record(0, "rollout/long/fp32", "rollout", row, "w", {}, "", "", "")
    folder = tmp_path / "csvs"
    folder.mkdir()
    text = ROLLOUT_TABLE.csv([record], {})
    assert len(text) > 2 * 131072  # two lists of 9,000 numbers, each beyond the default limit
    (folder / "rollout_logprobs.csv").write_text(text)
    result = invoke("analyze", folder)
    assert result.exit_code == 0, result.output
    claims = json.loads((folder / "claims.json").read_text())["rollout_mismatch"]["fp32"]
    assert claims["scorers"]["hf:fp32"]["metrics"]["tokens"] == n


def test_the_trainer_loads_its_precision_as_trainers_load_it(
    tmp_path: Path, tiny_dirs, items: Path
) -> None:
    """An hf trainer loads bf16 as from_pretrained(dtype=bf16) leaves the model (the
    rotary inv_freq kept in fp32), records so, and with --trainer-load cast as every run
    loads (every floating tensor cast): the two score the same tokens differently, each
    equal to its plain transformers forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = tiny_dirs["qwen2"]
    found = {}
    for load in ("pretrained", "cast"):
        out = tmp_path / load
        extra = () if load == "pretrained" else ("--trainer-load", "cast")
        rollout(out, model, items, "--n", 1, "--dtypes", "fp32", "--scorers", "hf:bf16", *extra)
        config = json.loads((out / "manifest.json").read_text())["experiments"]["rollout"]
        assert config["config"]["scorers"][0]["load"] == load
        (row,) = rows(out)
        turn = row["rollouts"][0]["turns"][0]
        plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        if load == "cast":
            plain = plain.to(torch.bfloat16)
        ids = row["prompt_token_ids"] + turn["token_ids"]
        with torch.inference_mode():
            logits = plain(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        start = len(row["prompt_token_ids"]) - 1
        expected = [float(logits[start + i, t]) for i, t in enumerate(turn["token_ids"])]
        found[load] = turn["scores"]["hf:bf16"]["logprobs"]
        assert found[load] == expected
    assert found["pretrained"] != found["cast"]
