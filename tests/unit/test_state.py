"""Boundary states: replicas, comparison, fingerprints, transplant, safetensors I/O."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import tiny
import torch
from helpers import (
    ARCHS,
    DTYPES,
    PLAN,
    PROMPTS,
    SHORT,
    bit_equal,
    bits,
    cache_equal,
    perturbed,
    reach,
    state_equal,
)
from safetensors.torch import save_file

from kvreplay import (
    KvreplayError,
    build,
    clone,
    compare,
    continue_from,
    fingerprint_tensors,
    first_divergence,
    load_model,
    load_state,
    make_replica,
    save_state,
    sha256_tokens,
    transplant,
)
from kvreplay.backends.hf.state import HfState
from kvreplay.model.state import read_state_metadata, storage_disjoint

# --- replicas -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_replica_is_bit_equal_and_storage_disjoint(tiny_lm, arch: str, dtype: str) -> None:
    lm = tiny_lm(arch, dtype)
    state, _ = reach(lm)
    replica, check = make_replica(state)
    assert check.passed and check.cache_exact and check.logits_exact and check.storage_disjoint
    assert state_equal(state, replica)
    assert storage_disjoint(state, replica)
    assert replica.cache_fingerprint() == state.cache_fingerprint()
    assert continue_from(lm, replica, SHORT).token_ids == continue_from(lm, state, SHORT).token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_mutating_a_clone_leaves_the_original_intact(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    state, _ = reach(lm)
    before = (state.cache_fingerprint(), state.logits_fingerprint())
    replica, _ = make_replica(state)
    with torch.inference_mode():
        for keys, values in replica.layer_tensors():
            keys.add_(1)
            values.mul_(-1)
        replica.logits.zero_()
        replica.token_ids.append(0)
    assert (state.cache_fingerprint(), state.logits_fingerprint()) == before
    assert len(state.token_ids) == len(replica.token_ids) - 1


def test_shared_storage_is_detected(tiny_lm) -> None:
    state, _ = reach(tiny_lm("qwen2", "bf16"))
    alias = HfState(state.cache, state.logits.clone(), list(state.token_ids), "alias")
    assert not storage_disjoint(state, alias)
    view = HfState(clone(state).cache, state.logits[:10], list(state.token_ids), "view")
    assert not storage_disjoint(state, view)


# --- comparison -----------------------------------------------------------------------


def test_compare_fields_follow_their_definitions(tiny_lm) -> None:
    lm = tiny_lm("llama", "bf16")
    state, prefix = reach(lm, PLAN)
    prefill = build(lm, prefix, "prefill")
    comparison = compare(state, prefill)
    pairs = list(zip(state.layer_tensors(), prefill.layer_tensors(), strict=True))
    left = torch.cat([t.double().reshape(-1) for (k, v), _ in pairs for t in (k, v)])
    right = torch.cat([t.double().reshape(-1) for _, (k, v) in pairs for t in (k, v)])
    delta = (left - right).norm().item()
    cache = comparison.cache
    assert cache["left_l2_norm"] == pytest.approx(left.norm().item(), rel=1e-9)
    assert cache["right_l2_norm"] == pytest.approx(right.norm().item(), rel=1e-9)
    assert cache["delta_l2_norm"] == pytest.approx(delta, rel=1e-9)
    assert cache["relative_l2_diff"] == pytest.approx(
        delta / max(cache["left_l2_norm"], cache["right_l2_norm"]), rel=1e-12
    )
    assert cache["max_abs_diff"] == (left - right).abs().max().item()
    assert cache["mean_abs_diff"] == pytest.approx((left - right).abs().mean().item(), rel=1e-9)
    # Per layer, K and V apart; the overall squared norms are the sums of the parts.
    assert len(comparison.per_layer) == lm.num_layers
    for index, ((lk, lv), (rk, rv)) in enumerate(pairs):
        layer = comparison.per_layer[index]
        assert layer["k"]["exact"] == torch.equal(lk, rk)
        assert layer["v"]["exact"] == torch.equal(lv, rv)
        assert layer["k"]["delta_l2_norm"] == pytest.approx((lk.double() - rk.double()).norm())
        assert layer["v"]["left_l2_norm"] == pytest.approx(lv.double().norm())
    assert math.fsum(lay["k"]["delta_l2_norm"] ** 2 for lay in comparison.per_layer) == (
        pytest.approx(comparison.keys["delta_l2_norm"] ** 2)
    )
    assert comparison.keys["delta_l2_norm"] ** 2 + comparison.values[
        "delta_l2_norm"
    ] ** 2 == pytest.approx(cache["delta_l2_norm"] ** 2)
    assert comparison.relative_l2_by_layer() == [
        lay["kv"]["relative_l2_diff"] for lay in comparison.per_layer
    ]
    assert comparison.logits["exact"] == bit_equal(state.logits, prefill.logits)
    assert comparison.boundary_argmax_equal == (state.argmax() == prefill.argmax())
    assert comparison.layer_lengths_equal
    assert json.dumps(comparison.to_dict())  # plain data, ready for a ledger


def test_compare_of_a_state_with_itself_is_exact_and_zero(tiny_lm) -> None:
    state, _ = reach(tiny_lm("gemma3", "bf16"))
    comparison = compare(state, clone(state))
    assert comparison.cache_exact and comparison.logits_exact
    assert comparison.cache["delta_l2_norm"] == 0.0 == comparison.cache["relative_l2_diff"]
    assert all(layer["kv"]["exact"] for layer in comparison.per_layer)


def test_states_over_different_prefixes_are_not_comparable(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    state, _ = reach(lm)
    other, _ = reach(lm, prompt="something else")
    with pytest.raises(KvreplayError, match="different prefixes"):
        compare(state, other)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1, 2], 2),
        ([], [4], 0),
    ],
)
def test_first_divergence(a: list[int], b: list[int], expected: int | None) -> None:
    assert first_divergence(a, b) == expected


# --- fingerprints ---------------------------------------------------------------------


def test_sha256_tokens_is_sha256_of_canonical_json() -> None:
    assert sha256_tokens([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()
    assert sha256_tokens([]) == hashlib.sha256(b"[]").hexdigest()
    assert sha256_tokens((7,)) == hashlib.sha256(b"[7]").hexdigest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fingerprint_of_equal_tensors_is_equal_and_one_bit_changes_it(dtype) -> None:
    tensor = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert fingerprint_tensors([("t", tensor)]) == fingerprint_tensors([("t", tensor.clone())])
    flipped = tensor.clone()
    flipped_bits = bits(flipped)
    flipped_bits.view(-1)[5] ^= 1  # lowest mantissa bit of one element
    assert not bit_equal(flipped, tensor)
    assert fingerprint_tensors([("t", flipped)]) != fingerprint_tensors([("t", tensor)])


def test_fingerprint_header_holds_dtype_shape_and_name() -> None:
    tensor = torch.arange(12, dtype=torch.float32)
    base = fingerprint_tensors([("t", tensor)])
    assert fingerprint_tensors([("t", tensor.reshape(3, 4))]) != base  # same bytes, new shape
    assert fingerprint_tensors([("t", tensor.view(torch.int32))]) != base  # same bytes, new dtype
    assert fingerprint_tensors([("u", tensor)]) != base
    header = b"t|float32|[12]\n"
    assert base == hashlib.sha256(header + tensor.numpy().tobytes()).hexdigest()


def test_fingerprint_order_matters_and_views_hash_like_copies() -> None:
    a, b = torch.zeros(2), torch.ones(2)
    assert fingerprint_tensors([("a", a), ("b", b)]) != fingerprint_tensors([("b", b), ("a", a)])
    wide = torch.arange(12.0).reshape(3, 4)
    assert fingerprint_tensors([("t", wide.t())]) == fingerprint_tensors([("t", wide.t().clone())])


def test_state_fingerprints_match_across_exact_constructions(tiny_lm) -> None:
    """drift_qwen2's prefill differs from live by construction (tests/tiny.py), so the
    last assertion holds on every kernel family."""
    lm = tiny_lm("drift_qwen2", "bf16")
    state, prefix = reach(lm, PLAN, PROMPTS[1])
    replay, prefill = build(lm, prefix, "replay"), build(lm, prefix, "prefill")
    assert state.cache_fingerprint() == replay.cache_fingerprint()
    assert state.logits_fingerprint() == replay.logits_fingerprint()
    assert state.cache_fingerprint() != prefill.cache_fingerprint()


# --- transplant -----------------------------------------------------------------------


def _donor_and_recipient(lm):
    """A live state (recipient) and a donor over the same prefix whose K/V differ by
    seeded noise: copying semantics are then testable whatever the CPU's rounding."""
    state, _ = reach(lm, PLAN)
    donor = perturbed(state)
    assert not cache_equal(state, donor)
    return donor, state


@pytest.mark.parametrize("arch", ARCHS)
def test_full_transplant_copies_the_donor_cache(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    donor, recipient = _donor_and_recipient(lm)
    before = recipient.cache_fingerprint()
    result = transplant(donor, recipient)
    assert cache_equal(result, donor)
    assert compare(result, donor).cache_exact
    assert bit_equal(result.logits, recipient.logits)  # logits stay the recipient's
    assert recipient.cache_fingerprint() == before  # the recipient itself is untouched
    assert storage_disjoint(result, donor) and storage_disjoint(result, recipient)
    assert result.construction == "transplant(perturbed->live;all;kv)"


@pytest.mark.parametrize("arch", ARCHS)
def test_full_transplant_with_logits_continues_like_the_donor(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    donor, recipient = _donor_and_recipient(lm)
    result = transplant(donor, recipient, carry_logits=True)
    assert state_equal(result, donor)
    expected = continue_from(lm, clone(donor), PLAN).token_ids
    assert continue_from(lm, result, PLAN).token_ids == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_subset_transplant_writes_only_those_layers(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    donor, recipient = _donor_and_recipient(lm)
    result = transplant(donor, recipient, layers=[1])
    for index, (keys, values) in enumerate(result.layer_tensors()):
        source = donor if index == 1 else recipient
        source_keys, source_values = source.layer_tensors()[index]
        assert bit_equal(keys, source_keys) and bit_equal(values, source_values)
    assert result.construction.endswith(";1;kv)")


@pytest.mark.parametrize("component", ["k", "v"])
@pytest.mark.parametrize("arch", ARCHS)
def test_keys_only_or_values_only_transplant(tiny_lm, arch: str, component: str) -> None:
    lm = tiny_lm(arch, "bf16")
    donor, recipient = _donor_and_recipient(lm)
    result = transplant(donor, recipient, component=component)
    for (keys, values), (dk, dv), (rk, rv) in zip(
        result.layer_tensors(), donor.layer_tensors(), recipient.layer_tensors(), strict=True
    ):
        assert bit_equal(keys, dk if component == "k" else rk)
        assert bit_equal(values, dv if component == "v" else rv)
    comparison = compare(result, donor)
    assert comparison.keys["exact"] == (component == "k")
    assert comparison.values["exact"] == (component == "v")


@pytest.mark.parametrize("arch", ARCHS)
def test_transplant_into_an_identical_state_changes_nothing(tiny_lm, arch: str) -> None:
    lm = tiny_lm(arch, "bf16")
    state, _ = reach(lm)
    result = transplant(clone(state), state, carry_logits=True)
    assert state_equal(result, state)
    assert continue_from(lm, result, SHORT).token_ids == continue_from(lm, state, SHORT).token_ids


def test_transplant_refuses_bad_layers_prefixes_and_components(tiny_lm) -> None:
    lm = tiny_lm("qwen2", "bf16")
    state, _ = reach(lm)
    other, _ = reach(lm, prompt="a different prompt")
    for layers in ([lm.num_layers], [-1]):
        with pytest.raises(KvreplayError, match="out of range"):
            transplant(clone(state), state, layers=layers)
    with pytest.raises(KvreplayError, match="different prefixes"):
        transplant(other, state)
    with pytest.raises(KvreplayError, match="component"):
        transplant(clone(state), state, component="q")  # type: ignore[arg-type]


# --- safetensors I/O ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip_is_bit_exact(tiny_lm, tmp_path: Path, arch: str, dtype: str) -> None:
    lm = tiny_lm(arch, dtype)
    state, _ = reach(lm)
    path = tmp_path / "snapshots" / "state.safetensors"
    info = save_state(state, path, extra={"item": "r0001"})
    loaded = load_state(path, lm.model)
    assert state_equal(loaded, state)
    assert loaded.construction == "live"
    assert loaded.cache_fingerprint() == info.cache_fingerprint == state.cache_fingerprint()
    assert loaded.logits_fingerprint() == info.logits_fingerprint
    assert read_state_metadata(path).extra == {"item": "r0001"}
    assert read_state_metadata(path).layer_lengths == state.layer_lengths()
    before = continue_from(lm, clone(state), SHORT)
    assert continue_from(lm, loaded, SHORT).token_ids == before.token_ids


def test_snapshot_has_no_pickle_and_no_temp_file(tiny_lm, tmp_path: Path) -> None:
    state, _ = reach(tiny_lm("gemma3", "bf16"))
    path = tmp_path / "s.safetensors"
    save_state(state, path)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert header["__metadata__"]["format"] == "kvreplay-boundary-state-v1"


def test_loading_something_else_is_refused(tiny_lm, tmp_path: Path) -> None:
    lm = tiny_lm("qwen2", "bf16")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(KvreplayError, match="not a readable safetensors"):
        load_state(garbage, lm.model)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(KvreplayError, match="not a kvreplay boundary-state"):
        load_state(foreign, lm.model)


def test_loading_into_a_model_with_other_layers_is_refused(tiny_lm, tmp_path: Path) -> None:
    state, _ = reach(tiny_lm("qwen2", "bf16"))
    path = tmp_path / "s.safetensors"
    save_state(state, path)
    folder = tmp_path / "two-layers"
    tiny.build("qwen2", layers=2).save_pretrained(folder)
    tiny.byte_tokenizer().save_pretrained(folder)
    with pytest.raises(KvreplayError, match="has 3 layers but the model has 2"):
        load_state(path, load_model(str(folder), "bf16").model)
