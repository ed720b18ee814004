"""Verdicts from outcomes alone: what each expectation accepts, and a served check whose
hits read no cached block (P shorter than one block) never passing as a cache check."""

from __future__ import annotations

from kvreplay.verdict import Expectation, ItemOutcome, Verdict

EXACT = Expectation("exact")


def outcome(item: str, differs: bool = False, cached: int | None = None) -> ItemOutcome:
    return ItemOutcome(item, "bf16", True, True, suffix_differs=differs,
                       first_divergence=3 if differs else None, left_margin=0.1 if differs
                       else None, right_margin=0.2 if differs else None,
                       cache_hit_tokens=cached)  # fmt: skip


def test_exact_holds_only_when_no_suffix_differs() -> None:
    assert Verdict(EXACT, ("live", "prefill"), [outcome("a"), outcome("b")]).exit_code == 0
    failing = Verdict(EXACT, ("live", "prefill"), [outcome("a"), outcome("b", differs=True)])
    assert failing.exit_code == 1
    assert "differ on 1 of 2 item(s) in bf16; 1 of those part at a near-tie" in failing.sentence()


def test_max_divergent_counts_divergent_items() -> None:
    items = [outcome("a", differs=True), outcome("b", differs=True), outcome("c")]
    assert Verdict(Expectation("max-divergent", 2), ("l", "p"), items).holds
    assert not Verdict(Expectation("max-divergent", 1), ("l", "p"), items).holds


def test_hits_that_read_no_cached_block_are_no_cache_check() -> None:
    vacuous = Verdict(EXACT, ("cache-hit", "cache-miss"), [outcome("a", cached=0)] * 3)
    assert not vacuous.holds and vacuous.exit_code == 1
    assert "no prefix-cache hit read a cached token of P on any item" in vacuous.sentence()
    mixed = Verdict(EXACT, ("cache-hit", "cache-miss"), [outcome("a", cached=0),
                                                         outcome("b", cached=96)])  # fmt: skip
    assert mixed.holds
    assert "(1 item(s) read no cached token of P" in mixed.sentence()
