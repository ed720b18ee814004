"""Continuation: greedy and seeded decoding, stage segments, openers, margins, stops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import ARCHS, PLAN, SHORT, reach

from kvreplay import KvreplayError, Sampler, Trajectory, clone, continue_from, encode_prompt, live
from kvreplay.core.stages import Stage, StagePlan, eos_ids, opener_ids
from kvreplay.model.decode import top2_margin


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_records_stages_margins_and_consumes_the_state(
    tiny_lm, arch: str
) -> None:
    lm = tiny_lm(arch, "bf16")
    state, prefix = reach(lm, PLAN)
    first = state.argmax()
    top = torch.topk(state.logits.float(), 2).values
    trajectory = continue_from(lm, state, PLAN)
    segments = trajectory.segments
    assert [s.stage for s in segments] == ["trace", "answer"]
    assert segments[0].token_ids[0] == first
    assert segments[0].margins[0] == pytest.approx(float(top[0] - top[1]))
    assert segments[1].opener_ids == opener_ids(lm.tokenizer, PLAN.stages[2])
    for segment, stage in zip(segments, PLAN.suffix_stages, strict=True):
        assert 0 < len(segment.token_ids) <= stage.max_new_tokens
        assert len(segment.margins) == len(segment.token_ids)
        assert all(m >= 0 for m in segment.margins)
        assert segment.stop_reason in ("cap", "eos") or segment.stop_reason.startswith("stop:")
    assert trajectory.token_ids == [t for s in segments for t in s.opener_ids + s.token_ids]
    # Every suffix token but the last was fed: nothing reads the state after it.
    assert state.token_ids == prefix.token_ids + trajectory.token_ids[:-1]


def test_trajectory_round_trips_through_a_dict(tiny_lm) -> None:
    state, _ = reach(tiny_lm("llama", "bf16"))
    trajectory = continue_from(tiny_lm("llama", "bf16"), state, SHORT)
    again = Trajectory.from_dict(trajectory.to_dict())
    assert again.token_ids == trajectory.token_ids
    assert again.stage("answer").opener_ids == trajectory.stage("answer").opener_ids
    assert again.stage("nope") is None


def test_top2_margin() -> None:
    assert top2_margin(torch.tensor([0.5, 3.0, 1.0, 3.0])) == 0.0
    assert top2_margin(torch.tensor([1.0, -2.0, 0.25], dtype=torch.bfloat16)) == 0.75


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_is_reproducible_and_differs_across_seeds(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    state, _ = reach(lm)

    def draw(seed: int) -> list[int]:
        sampler = Sampler(temperature=1.0, top_p=0.95, seed=seed)
        return continue_from(lm, clone(state), SHORT, sampler).token_ids

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_tiny_top_p_sampling_is_greedy(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    state, _ = reach(lm)
    greedy = continue_from(lm, clone(state), SHORT).token_ids
    nucleus = Sampler(temperature=0.7, top_p=1e-9, seed=3)
    assert continue_from(lm, clone(state), SHORT, nucleus).token_ids == greedy


def test_seeded_sampling_reaches_the_boundary_reproducibly(tiny_lm) -> None:
    lm = tiny_lm("gemma3", "bf16")
    ids = encode_prompt(lm.tokenizer, "sample me")
    sampler = Sampler(temperature=1.0, seed=11)
    assert live(lm, ids, SHORT, sampler)[1].token_ids == live(lm, ids, SHORT, sampler)[1].token_ids


@pytest.mark.parametrize(("temperature", "top_p"), [(-0.1, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_sampler_rejects_bad_settings(temperature: float, top_p: float) -> None:
    with pytest.raises(KvreplayError, match="temperature|top-p"):
        Sampler(temperature=temperature, top_p=top_p)


def test_greedy_sampler_has_no_generator() -> None:
    assert Sampler().greedy and Sampler().generator() is None


def test_opener_that_tokenizes_to_nothing_is_refused() -> None:
    silent = SimpleNamespace(encode=lambda text, add_special_tokens=False: [])
    with pytest.raises(KvreplayError, match="tokenizes to nothing"):
        opener_ids(silent, Stage("answer", 4, opener="\u200b"))
    assert opener_ids(silent, Stage("answer", 4)) == []


def test_empty_opener_is_refused_before_model_work(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    silent = SimpleNamespace(
        encode=lambda text, add_special_tokens=False: [],
        decode=lm.tokenizer.decode,
        eos_token_id=lm.tokenizer.eos_token_id,
    )
    quiet_lm = SimpleNamespace(
        model=None, tokenizer=silent, context_length=lm.context_length
    )  # model=None: any model work would fail differently
    plan = StagePlan("o", (Stage("think", 3), Stage("answer", 2, opener="x")))
    with pytest.raises(KvreplayError, match="tokenizes to nothing"):
        live(quiet_lm, [65, 66], plan)


def test_a_stop_string_ends_the_stage_on_its_last_token(tiny_lm) -> None:
    """Take the printable text of three decoded tokens as the stop: the stage ends there."""
    lm = tiny_lm("llama", "bf16")
    state, _ = reach(lm)
    free = continue_from(lm, clone(state), PLAN).segments[0].token_ids
    stop = next(
        text
        for i in range(len(free) - 2)
        if len(text := lm.tokenizer.decode(free[i : i + 3])) == 3 and text.isprintable()
    )
    end = next(i for i in range(len(free)) if stop in lm.tokenizer.decode(free[: i + 1]))
    assert end < len(free) - 1
    plan = StagePlan(
        "stop", (Stage("think", 10), Stage("trace", 48, stop=(stop,)), Stage("answer", 2))
    )
    trace = continue_from(lm, clone(state), plan).segments[0]
    assert trace.token_ids == free[: end + 1]
    assert trace.stop_reason == f"stop:{stop}"


def test_eos_ids_merge_tokenizer_and_generation_config(tiny_lm) -> None:
    lm = tiny_lm("llama", "bf16")
    assert lm.tokenizer.eos_token_id in eos_ids(lm.tokenizer, lm.model)
    assert 256 in eos_ids(lm.tokenizer, lm.model)
