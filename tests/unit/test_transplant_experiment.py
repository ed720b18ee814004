"""K/V transplantation on tiny models: what a transplant guarantees, what it writes, and
the pieces of ``transplant`` and ``localize`` that need no run directory."""

from __future__ import annotations

import pytest
from helpers import PLAN, PROMPTS, bit_equal, find_divergence, reach, state_equal

from kvreplay import KvreplayError, build, continue_from
from kvreplay.core.comparison import first_divergence
from kvreplay.core.sampler import Sampler
from kvreplay.experiments.localize.experiment import Prober, bisect, follow, sweep
from kvreplay.experiments.localize.table import layer_label
from kvreplay.harness.executor import holds_donor
from kvreplay.harness.selection import spread
from kvreplay.model.state import clone, transplant


@pytest.fixture(scope="module")
def divergent_pairs(tiny_lm):
    """(lm, replay, prefill, replay suffix, prefill suffix) for two prompts whose suffix
    diverges: drift_qwen2's prefill drifts by construction (tests/tiny.py), so the pool
    search finds them on every kernel family."""
    lm = tiny_lm("drift_qwen2", "bf16")
    pairs = []
    for prompt in find_divergence(lm, PLAN, want=2).divergent[:2]:
        _, prefix = reach(lm, PLAN, prompt)
        replay, prefill = build(lm, prefix, "replay"), build(lm, prefix, "prefill")
        suffixes = [continue_from(lm, clone(s), PLAN).token_ids for s in (replay, prefill)]
        pairs.append((lm, replay, prefill, *suffixes))
    return pairs


def test_full_transplant_recovers_the_donor_on_every_divergent_row(divergent_pairs) -> None:
    """With equal boundary argmaxes a K/V-only transplant is the donor's computation from
    the first suffix token on, so its continuation is the donor's, token for token."""
    for lm, replay, prefill, replay_suffix, prefill_suffix in divergent_pairs:
        assert replay_suffix != prefill_suffix
        assert replay.argmax() == prefill.argmax()
        for donor, recipient, donor_suffix in (
            (replay, prefill, replay_suffix),
            (prefill, replay, prefill_suffix),
        ):
            moved = transplant(donor, recipient)
            assert holds_donor(moved, donor)
            assert bit_equal(moved.logits, recipient.logits)  # K/V only
            assert continue_from(lm, moved, PLAN).token_ids == donor_suffix


def test_carrying_the_logits_makes_the_recipient_the_donor(divergent_pairs) -> None:
    lm, replay, prefill, replay_suffix, _ = divergent_pairs[0]
    moved = transplant(replay, prefill, carry_logits=True)
    assert state_equal(moved, replay)
    assert continue_from(lm, moved, PLAN).token_ids == replay_suffix


def test_transplanting_into_an_identical_state_changes_nothing(divergent_pairs) -> None:
    lm, replay, _, replay_suffix, _ = divergent_pairs[0]
    moved = transplant(clone(replay), replay)
    assert state_equal(moved, replay)
    assert continue_from(lm, moved, PLAN).token_ids == replay_suffix


@pytest.mark.parametrize("component", ["kv", "k", "v"])
def test_a_layer_subset_writes_only_those_layers(divergent_pairs, component: str) -> None:
    _, replay, prefill, _, _ = divergent_pairs[0]
    untouched = (prefill.cache_fingerprint(), prefill.logits_fingerprint())
    moved = transplant(replay, prefill, layers=[1], component=component)
    layers = zip(
        moved.layer_tensors(), replay.layer_tensors(), prefill.layer_tensors(), strict=True
    )
    for index, ((keys, values), (donor_k, donor_v), (own_k, own_v)) in enumerate(layers):
        assert bit_equal(keys, donor_k if index == 1 and component != "v" else own_k)
        assert bit_equal(values, donor_v if index == 1 and component != "k" else own_v)
    assert bit_equal(moved.logits, prefill.logits)
    assert (prefill.cache_fingerprint(), prefill.logits_fingerprint()) == untouched
    assert not holds_donor(moved, replay)


def test_bad_transplants_are_refused_in_one_sentence(tiny_lm, divergent_pairs) -> None:
    lm, replay, prefill, _, _ = divergent_pairs[0]
    with pytest.raises(KvreplayError, match=r"^Layer index 3 is out of range for a 3-layer"):
        transplant(replay, prefill, layers=[3])
    _, other_prefix = reach(lm, PLAN, PROMPTS[1])
    with pytest.raises(KvreplayError, match="different prefixes"):
        transplant(build(lm, other_prefix, "prefill"), prefill)
    shorter = build(lm, other_prefix, "prefill")
    shorter.token_ids = list(prefill.token_ids)  # same ids claimed, different cache shapes
    with pytest.raises(KvreplayError, match="different shapes"):
        transplant(shorter, prefill)
    with pytest.raises(KvreplayError, match="Unknown component"):
        transplant(replay, prefill, component="q")  # type: ignore[arg-type]


def test_follow_agrees_with_a_full_continuation(divergent_pairs) -> None:
    """Decoding only while a state follows the reference gives the exact first divergence."""
    for lm, replay, prefill, replay_suffix, prefill_suffix in divergent_pairs:
        reference = continue_from(lm, clone(replay), PLAN)
        assert follow(lm, clone(replay), reference, Sampler()) is None
        expected = first_divergence(replay_suffix, prefill_suffix)
        assert follow(lm, clone(prefill), reference, Sampler()) == expected


def test_spread_takes_order_statistics_and_the_seed_only_breaks_ties() -> None:
    lengths = {f"r{i}": 10 * i for i in range(10)}
    assert spread(lengths, 3, seed=0) == ["r0", "r4", "r9"] == spread(lengths, 3, seed=7)
    assert spread(lengths, 20, seed=0) == [f"r{i}" for i in range(10)]
    tied = {f"t{i}": 5 for i in range(6)}
    picks = {tuple(spread(tied, 2, seed)) for seed in range(8)}
    assert len(picks) > 1  # equal lengths: the seed decides
    assert spread(tied, 2, seed=3) == spread(tied, 2, seed=3)


def test_layer_labels() -> None:
    assert layer_label([5]) == "5"
    assert layer_label(range(4)) == "0-3"
    assert layer_label([7, 0, 1, 2]) == "0-2,7"


def _prober(sufficient: set[int]) -> Prober:
    """A prober whose layer sets recover iff they hold every layer in ``sufficient``."""
    return Prober("d", lambda layers, component: None if sufficient <= set(layers) else 0)


@pytest.mark.parametrize(("sufficient", "window"), [({5}, (5, 6)), ({0}, (0, 1)), ({3, 4}, (0, 8))])
def test_bisection_is_deterministic_and_bounded(sufficient: set[int], window) -> None:
    """{3, 4} straddles the first split, so neither half suffices and the window stays."""
    first, second = _prober(sufficient), _prober(sufficient)
    assert bisect(first, 8) == bisect(second, 8) == window
    assert first.probes == second.probes
    assert len(first.probes) <= 1 + 2 * 3


def test_sweep_decodes_each_layer_set_once() -> None:
    decoded: list[tuple[tuple[int, ...], str]] = []

    def decide(layers: tuple[int, ...], component: str) -> int | None:
        decoded.append((layers, component))
        return None if 2 in layers and component != "k" else 4

    prober = Prober("d", decide)
    sweep(prober, 4)
    assert len(decoded) == len(set(decoded))
    # 4 single + 4 prefixes + 3 new suffixes + k + v, then bisection reuses or adds few.
    assert len(decoded) <= 4 + 4 + 3 + 2 + 2
    minimal = [p for p in prober.probes if p.sweep == "minimal"]
    assert [(p.layers, p.recovers_donor) for p in minimal] == [([2], True)]
    single = {p.layers[0]: p.recovers_donor for p in prober.probes if p.sweep == "single"}
    assert single == {0: False, 1: False, 2: True, 3: False}
