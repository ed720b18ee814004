"""Constructions of a boundary state: live, replay, prefill, chunked:K, stepwise."""

from __future__ import annotations

import pytest
from helpers import (
    ARCHS,
    DTYPES,
    PLAN,
    PROMPT_POOL,
    PROMPTS,
    SHORT,
    find_divergence,
    reach,
    state_equal,
)

from kvreplay import KvreplayError, build, clone, compare, continue_from, encode_prompt, live
from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.stages import Stage, StagePlan, opener_ids
from kvreplay.model.construct import parse_construction
from kvreplay.model.state import BoundaryState


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_replay_is_bit_exact_with_live(tiny_lm, arch: str, dtype: str) -> None:
    lm = tiny_lm(arch, dtype)
    state, prefix = reach(lm, PLAN)
    replay = build(lm, prefix, "replay")
    assert state_equal(state, replay)
    comparison = compare(state, replay)
    assert comparison.cache_exact and comparison.logits_exact
    assert comparison.cache["max_abs_diff"] == 0.0
    live_suffix = continue_from(lm, state, PLAN)
    replay_suffix = continue_from(lm, replay, PLAN)
    assert live_suffix.token_ids == replay_suffix.token_ids
    assert [s.margins for s in live_suffix.segments] == [s.margins for s in replay_suffix.segments]


def test_bf16_prefill_cache_drifts_from_live_on_some_prompt(tiny_lm) -> None:
    """The robust form of the phenomenon on tiny models: over ARCHS x PROMPT_POOL, some
    bf16 prefill cache is not bit-exact with live, and no drift is large. How many drift,
    and whether a suffix then changes, depends on the CPU's kernel family: measured with
    the portable kernels, 4 of 48 tiny-model prefills drift (llama's none) and no suffix
    diverged in 216 tries, against 44 of 48 with AVX2. The suffix
    divergence itself is asserted on SmolLM2 (test_smollm2.py)."""
    drifted = []
    for arch in ARCHS:
        lm = tiny_lm(arch, "bf16")
        for prompt in PROMPT_POOL:
            state, prefix = reach(lm, PLAN, prompt)
            comparison = compare(state, build(lm, prefix, "prefill"))
            assert comparison.cache["relative_l2_diff"] < 0.1
            drifted += [(arch, prompt)] * (not comparison.cache_exact)
    assert drifted, "every tiny-model bf16 prefill cache was bit-exact with live"


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_agrees_with_live_to_fp32_rounding(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "fp32")
    state, prefix = reach(lm, PLAN)
    comparison = compare(state, build(lm, prefix, "prefill"))
    assert comparison.cache["relative_l2_diff"] < 1e-5


def test_a_drifting_prefill_is_found_and_its_suffix_differs(tiny_lm) -> None:
    """kvreplay's detection on a prefill that drifts by construction (drift_qwen2, the
    same on every CPU): replay stays bit-exact with live, prefill does not, and the pool
    holds both a divergent and an exact prompt."""
    lm = tiny_lm("drift_qwen2", "bf16")
    found = find_divergence(lm, PLAN)
    state, prefix = reach(lm, PLAN, found.divergent[0])
    assert state_equal(state, build(lm, prefix, "replay"))
    prefill = build(lm, prefix, "prefill")
    assert not compare(state, prefill).cache_exact
    live_suffix = continue_from(lm, clone(state), PLAN).token_ids
    assert continue_from(lm, prefill, PLAN).token_ids != live_suffix


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_stepwise_equals_chunked_1(tiny_lm, arch: str, dtype: str) -> None:
    lm = tiny_lm(arch, dtype)
    _, prefix = reach(lm)
    assert state_equal(build(lm, prefix, "stepwise"), build(lm, prefix, "chunked:1"))


@pytest.mark.parametrize("arch", ARCHS)
def test_one_chunk_covering_the_prefix_equals_prefill(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    _, prefix = reach(lm)
    whole = build(lm, prefix, f"chunked:{len(prefix.token_ids) + 5}")
    assert state_equal(whole, build(lm, prefix, "prefill"))


@pytest.mark.parametrize(
    "construction", ["replay", "prefill", "stepwise", "chunked:1", "chunked:7"]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_construction_covers_the_prefix(tiny_lm, arch: str, construction: str) -> None:
    lm = tiny_lm(arch, "bf16")
    state, prefix = reach(lm)
    built = build(lm, prefix, construction)
    assert built.construction == construction
    assert built.token_ids == prefix.token_ids == state.token_ids
    assert built.layer_lengths() == [len(prefix.token_ids)] * lm.num_layers
    assert built.logits is not None and built.logits.shape == state.logits.shape
    assert built.logits.dtype == lm.dtype


def test_gemma3_sliding_layers_store_only_their_window(tiny_lm) -> None:
    lm = tiny_lm("gemma3", "bf16")
    state, prefix = reach(lm)
    stored = [keys.shape[2] for keys, _ in state.layer_tensors()]
    assert stored[-1] == len(prefix.token_ids)  # the full-attention layer
    assert all(n < len(prefix.token_ids) for n in stored[:-1])  # sliding, window 8


@pytest.mark.parametrize("name", ["live", "replay", "prefill", "stepwise", "chunked:3"])
def test_parse_construction_accepts_known_names(name: str) -> None:
    kind, size = parse_construction(name)
    assert kind == name.partition(":")[0] and size == (3 if kind == "chunked" else 0)


@pytest.mark.parametrize("name", ["", "chunked", "chunked:0", "chunked:x", "chunked:-2", "greedy"])
def test_parse_construction_rejects_unknown_names(name: str) -> None:
    with pytest.raises(KvreplayError, match="Unknown construction"):
        parse_construction(name)


def test_live_cannot_be_rebuilt(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    _, prefix = reach(lm)
    with pytest.raises(KvreplayError, match="live"):
        build(lm, prefix, "live")


def test_prefix_records_prompt_stages_and_digest(tiny_lm) -> None:
    lm = tiny_lm("llama", "bf16")
    prompt_ids = encode_prompt(lm.tokenizer, PROMPTS[1])
    state, prefix = live(lm, prompt_ids, SHORT)
    assert prefix.prompt_len == len(prompt_ids)
    assert prefix.token_ids[: len(prompt_ids)] == prompt_ids
    assert [s.stage for s in prefix.segments] == ["think"]
    assert prefix.token_ids[len(prompt_ids) :] == prefix.segments[0].token_ids
    assert prefix.reached and prefix.reason == ""
    assert prefix.sha256 == sha256_tokens(prefix.token_ids)
    assert state.position == len(prefix.token_ids)


def test_live_feeds_the_opener_of_the_stage_after_the_boundary(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    plan = StagePlan("o", (Stage("think", 5), Stage("answer", 3, opener="\nA:")))
    state, prefix = reach(lm, plan)
    opener = opener_ids(lm.tokenizer, plan.stages[1])
    assert prefix.token_ids[-len(opener) :] == opener
    assert len(prefix.token_ids) == prefix.prompt_len + 5 + len(opener)
    assert state_equal(state, build(lm, prefix, "replay"))
    suffix = continue_from(lm, state, plan)
    assert suffix.segments[0].opener_ids == opener


def test_prefix_not_reached_when_a_stop_never_fires(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    plan = StagePlan("s", (Stage("think", 4, stop=("\x00never\x00",)), Stage("answer", 2)))
    _, prefix = reach(lm, plan)
    assert not prefix.reached
    assert prefix.reason == "stage 'think' ended by cap"


def test_context_overflow_is_refused_before_model_work(tiny_lm, monkeypatch) -> None:
    lm = tiny_lm("qwen2", "bf16")

    def no_model_work(*_args, **_kwargs):
        raise AssertionError("the model ran before the context check")

    monkeypatch.setattr(BoundaryState, "advance", no_model_work)
    plan = StagePlan("big", (Stage("think", lm.context_length), Stage("answer", 4)))
    with pytest.raises(KvreplayError, match="context window"):
        live(lm, encode_prompt(lm.tokenizer, "hi"), plan)
    with pytest.raises(KvreplayError, match="context window"):
        live(lm, [65] * (lm.context_length + 1), SHORT)


def test_rebuilding_a_prefix_longer_than_the_context_is_refused(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    _, prefix = reach(lm)
    prefix.token_ids = [65] * (lm.context_length + 1)
    with pytest.raises(KvreplayError, match="context window"):
        build(lm, prefix, "prefill")


def test_continuing_a_clone_leaves_the_state_reusable(tiny_lm) -> None:
    lm = tiny_lm("gemma3", "bf16")
    state, prefix = reach(lm)
    before = (state.cache_fingerprint(), state.logits_fingerprint())
    first = continue_from(lm, clone(state), SHORT)
    second = continue_from(lm, clone(state), SHORT)
    assert first.token_ids == second.token_ids
    assert (state.cache_fingerprint(), state.logits_fingerprint()) == before
    assert state.token_ids == prefix.token_ids
