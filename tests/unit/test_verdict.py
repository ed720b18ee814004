"""Verdicts from outcomes alone: what each expectation accepts at which level, a pass
that states its power, a served check whose hits read no cached block never passing as
a cache check, the stop rule, and verdict JSON of both schemas read back."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from kvreplay.core.errors import KvreplayError
from kvreplay.core.power import items_needed, percent, rate_upper_bound
from kvreplay.core.trajectory import Segment, Trajectory, numeric_divergence
from kvreplay.verify.expectation import Expectation, parse_expectation
from kvreplay.verify.outcome import ItemOutcome
from kvreplay.verify.render import junit, read_json, screen, sentence, to_json
from kvreplay.verify.verdict import Verdict

EXACT = Expectation("exact")
BITWISE = Expectation("bitwise")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def outcome(
    item: str,
    differs: bool = False,
    cached: int | None = None,
    numerics: int | None = None,
    recorded: bool = True,
) -> ItemOutcome:
    return ItemOutcome(item, "bf16", True, True, suffix_differs=differs,
                       first_divergence=3 if differs else None, left_margin=0.1 if differs
                       else None, right_margin=0.2 if differs else None,
                       cache_hit_tokens=cached, logits_equal=numerics != 0,
                       numerics_recorded=recorded, numeric_divergence=numerics)  # fmt: skip


def test_exact_holds_only_when_no_suffix_differs() -> None:
    assert Verdict(EXACT, ("live", "prefill"), [outcome("a"), outcome("b")]).exit_code == 0
    failing = Verdict(EXACT, ("live", "prefill"), [outcome("a"), outcome("b", differs=True)])
    assert failing.exit_code == 1
    assert "differ on 1 of 2 item(s) in bf16, 1 of those at a near-tie" in sentence(failing)


def test_a_pass_names_its_level_power_and_what_the_bits_give() -> None:
    """The issue's scenario: 0 of 4 suffixes differ while the hit's logits differ on 4."""
    items = [outcome(i, cached=96, numerics=0) for i in "abcd"]
    verdict = Verdict(EXACT, ("cache-hit", "cache-miss"), items)
    assert verdict.holds
    assert sentence(verdict) == (
        "HOLDS at token level (every suffix equal): cache-hit and cache-miss continuations "
        "differ on 0 of 4 item(s) in bf16, so the divergence rate may still be up to 60% "
        "(95% upper bound); NOT bitwise: cache-hit and cache-miss numerics differ on 4 of 4 "
        "item(s), first at item a (bf16) from step 0 (the boundary logits); boundary logits "
        "differ on 4."
    )
    bitwise = Verdict(BITWISE, ("cache-hit", "cache-miss"), items)
    assert not bitwise.holds and sentence(bitwise).startswith("FAILS bitwise")


def test_bitwise_holds_only_on_recorded_equal_numerics() -> None:
    equal = Verdict(BITWISE, ("l", "p"), [outcome("a"), outcome("b")])
    assert equal.holds
    assert (
        "agree bit for bit (every step's reported logprobs) on 2 of 2 item(s), so the "
        "rate of items whose numerics part may still be up to 84%" in sentence(equal)
    )
    late = Verdict(BITWISE, ("l", "p"), [outcome("a", numerics=17)])
    assert not late.holds and "from step 17" in sentence(late)
    unrecorded = Verdict(BITWISE, ("l", "p"), [outcome("a", recorded=False)])
    assert not unrecorded.holds and "bitwise unknown" in sentence(unrecorded)
    assert unrecorded.items[0].bits == "unknown"


def test_max_divergent_counts_divergent_items() -> None:
    items = [outcome("a", differs=True), outcome("b", differs=True), outcome("c")]
    assert Verdict(Expectation("max-divergent", 2), ("l", "p"), items).holds
    assert not Verdict(Expectation("max-divergent", 1), ("l", "p"), items).holds


def test_hits_that_read_no_cached_block_are_no_cache_check() -> None:
    vacuous = Verdict(EXACT, ("cache-hit", "cache-miss"), [outcome("a", cached=0)] * 3)
    assert not vacuous.holds and vacuous.exit_code == 1
    assert "no prefix-cache hit read a cached token of P on any item" in sentence(vacuous)
    mixed = Verdict(EXACT, ("cache-hit", "cache-miss"), [outcome("a", cached=0),
                                                         outcome("b", cached=96)])  # fmt: skip
    assert mixed.holds
    assert "(1 item(s) read no cached token of P" in sentence(mixed)
    assert mixed.levels()["tokens"]["items"] == 1  # the uncached item bounds nothing


def test_the_power_is_the_exact_upper_bound() -> None:
    assert rate_upper_bound(0, 4) == pytest.approx(0.6024, abs=1e-4)
    assert rate_upper_bound(4, 12) == pytest.approx(0.6511, abs=1e-4)  # Clopper-Pearson
    assert rate_upper_bound(0, 0) == 1.0
    assert items_needed(0.05) == 72 and rate_upper_bound(0, 71) >= 0.05 > rate_upper_bound(0, 72)
    needed = items_needed(0.05, 2)
    assert rate_upper_bound(2, needed) < 0.05 <= rate_upper_bound(2, needed - 1)
    assert percent(0.6024) == "60%" and percent(0.0499) == "4.99%"


@pytest.mark.parametrize("rate", [0.0, 1.0, 1.5, -0.1, float("nan"), float("inf")])
def test_max_rate_outside_0_1_is_refused(rate: float) -> None:
    with pytest.raises(KvreplayError, match="strictly between 0 and 1"):
        parse_expectation(None, None, None, 0.0, rate)


def test_numeric_divergence_counts_suffix_tokens_and_skips_forced_openers() -> None:
    def trajectory(digests: list[str], answer: list[str]) -> Trajectory:
        return Trajectory([
            Segment("trace", [], [1, 2, 3], "cap", [1.0] * 3, digests),
            Segment("answer", [9, 9], [4], "eos", [1.0], answer),
        ])  # fmt: skip

    same = trajectory(["a", "b", "c"], ["d"])
    assert numeric_divergence(same, trajectory(["a", "b", "c"], ["d"])).index is None
    assert numeric_divergence(same, trajectory(["a", "x", "c"], ["d"])).index == 1
    assert numeric_divergence(same, trajectory(["a", "b", "c"], ["y"])).index == 5
    old = Trajectory([Segment("trace", [], [1, 2, 3], "cap", [1.0] * 3)])
    assert not numeric_divergence(same, old).recorded


def test_verdict_json_of_either_schema_reads_back() -> None:
    environment = {"kvreplay_version": "0.1.0", "model": {}, "backend": {"name": "hf"}}
    items = [outcome("a"), outcome("b", differs=True)]
    data = to_json(Verdict(EXACT, ("l", "p"), items, environment=environment))
    jsonschema.validate(data, json.loads((DOCS / "check-v4.schema.json").read_text()))
    record = read_json(data)
    assert record.verdict == "fails" and record.levels["bits"]["holds"] is True
    assert read_json({**data, "schema": "kvreplay-check-v2"}).levels == record.levels
    v1 = {**data, "schema": "kvreplay-check-v1", "counts": {"reached": 4, "suffixes_differ": 0}}
    old = read_json(v1)
    assert old.levels["tokens"]["holds"] and old.levels["bits"] is None
    with pytest.raises(KvreplayError, match="Not a kvreplay verdict"):
        read_json({"schema": "kvreplay-check-v9"})


def test_a_hit_that_changes_under_traffic_fails_the_check_and_is_reported() -> None:
    """history under --traffic N: the hit and the miss agree everywhere, but the hit under
    traffic continued differently on one item: the check fails at token level, and the
    sentence, the JSON (schema v4) and the JUnit say where and what the server reported."""
    from dataclasses import replace

    alone = outcome("a", cached=96)
    busy = {"in_flight_max": 3, "server_running_max": 4.0, "server_waiting_max": None,
            "kv_cache_usage_max": 0.25, "preemptions": None}  # fmt: skip
    moved = replace(
        outcome("b", cached=96),
        traffic_differs=True,
        traffic_differs_from_right=True,
        traffic_numerics_differ=True,
        traffic_load=busy,
    )
    still = replace(
        outcome("c", cached=96),
        traffic_differs=False,
        traffic_differs_from_right=False,
        traffic_numerics_differ=False,
        traffic_load={**busy, "in_flight_max": 2, "kv_cache_usage_max": 0.5},
    )
    load = {**busy, "kv_cache_usage_max": 0.5}  # each figure's most over the items
    environment = {"kvreplay_version": "0.1.0", "model": {}, "backend": {"name": "http"}}
    verdict = Verdict(EXACT, ("hit", "miss"), [alone, moved, still], environment=environment)
    assert not verdict.holds and verdict.exit_code == 1
    assert (
        "hit and miss continuations differ on 0 of 3 item(s) in bf16; under traffic the hit "
        "continuation differs from the hit alone on 1 of 2 item(s) and from the miss on 1"
    ) in sentence(verdict)
    assert "NOT bitwise" in sentence(verdict)
    data = to_json(verdict)
    jsonschema.validate(data, json.loads((DOCS / "check-v4.schema.json").read_text()))
    assert data["traffic"] == {
        "items": 2,
        "suffix_differs_from": {"hit": 1, "miss": 1},
        "numerics_differ_from": {"hit": 1},
        "load": load,
    }
    xml = junit(verdict)
    assert 'name="traffic_suffix_differs_from_hit" value="1"' in xml
    assert "under traffic the continuation differs from the one alone" in xml
    assert "server running max 4" in screen(verdict)
    quiet = Verdict(EXACT, ("hit", "miss"), [alone, still])
    assert quiet.holds and to_json(quiet)["traffic"]["suffix_differs_from"]["hit"] == 0
    assert to_json(Verdict(EXACT, ("hit", "miss"), [alone]))["traffic"] is None
