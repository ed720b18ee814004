"""A re-executed row judged on another platform (audit/crossing.py, audit/platform.py):
on synthetic rows shaped as a matched row is, a trajectory may part only at a near tie,
what follows it is not comparable, numerics are not compared, and a forged token or
answer where the model was sure is still a problem."""

from __future__ import annotations

import copy

import pytest

from kvreplay.audit.crossing import Tally, cross, numeric, owner_of
from kvreplay.audit.platform import PIN, meet, pin_for
from kvreplay.ledger import diff_fields

BOUND = 1.0  # the near-tie bound these rows are judged under


def arm(tokens: list[int], margins: list[float], answer: str) -> dict:
    return {
        "answer": answer,
        "correct": answer == "4",
        "cache_fingerprint": "a" * 64,
        "suffix": {"segments": [{"stage": "answer", "token_ids": tokens, "margins": margins}]},
        "suffix_token_ids": tokens,
    }


def row() -> dict:
    """Keys in the ledger's (sorted) order: the arms before the prefix they continue."""
    return {
        "arms": {
            "left": arm([10, 11, 12], [2.0, 0.125, 3.0], "4"),
            "prefill": arm([10, 11, 12], [2.0, 0.25, 3.0], "4"),
        },
        "item_id": "r0000",
        "precision": "bf16",
        "prefix_stages": [{"stage": "think", "token_ids": [5, 6, 7], "margins": [3.0, 2.5, 4.0]}],
        "prefix_token_ids": [1, 2, 5, 6, 7],
        "comparison": {"first_suffix_divergence_index": None, "cache": {"max_abs_diff": 0.25}},
        "labels": {"flip": False},
    }


def judge(recorded: dict, fresh: dict, sampled: bool = False):
    return cross("matched/r0000/bf16", recorded, fresh, diff_fields(recorded, fresh), BOUND,
                 sampled)  # fmt: skip


def test_numerics_alone_are_not_compared_and_not_a_problem() -> None:
    recorded, fresh = row(), row()
    fresh["arms"]["left"]["cache_fingerprint"] = "b" * 64
    fresh["arms"]["left"]["suffix"]["segments"][0]["margins"][0] = 2.125
    fresh["comparison"]["cache"]["max_abs_diff"] = 0.5
    found = judge(recorded, fresh)
    assert found.problems == [] and found.numerics == 3 and found.near_ties == []


def test_parting_at_a_near_tie_leaves_what_follows_in_that_arm_uncompared() -> None:
    recorded, fresh = row(), row()
    left = fresh["arms"]["left"]
    left["suffix"]["segments"][0]["token_ids"][1:] = [99, 98]
    left["suffix"]["segments"][0]["margins"][1] = 0.0
    left["suffix_token_ids"][1:] = [99, 98]
    left["answer"], left["correct"] = "5", False
    fresh["comparison"]["first_suffix_divergence_index"] = 1
    fresh["labels"]["flip"] = True
    found = judge(recorded, fresh)
    assert found.problems == []
    assert found.near_ties == [
        "arms.left.suffix.segments[0] at step 1 (margins 0.125 recorded, 0 here)"
    ]
    assert found.after > 0


def test_parting_where_this_machine_is_sure_is_a_problem() -> None:
    recorded, fresh = row(), row()
    fresh["arms"]["prefill"]["suffix"]["segments"][0]["token_ids"][2] = 77
    found = judge(recorded, fresh)
    assert len(found.problems) == 1
    assert "arms.prefill.suffix.segments[0].token_ids[2]" in found.problems[0]
    assert "not the platform's rounding" in found.problems[0]


def test_a_forged_answer_over_equal_tokens_is_a_problem() -> None:
    recorded, fresh = row(), row()
    recorded["arms"]["left"]["answer"] = "5"  # the forger's edit; the tokens still say 4
    found = judge(recorded, fresh)
    assert [p for p in found.problems if "arms.left.answer" in p], found.problems


def test_a_prefix_parting_at_a_near_tie_leaves_the_whole_row_uncompared() -> None:
    recorded, fresh = row(), row()
    recorded["prefix_stages"][0]["margins"][1] = 0.5
    fresh["prefix_stages"][0]["token_ids"][1:] = [8, 9]
    fresh["prefix_stages"][0]["margins"][1] = 0.375
    fresh["prefix_token_ids"][3:] = [8, 9]
    fresh["arms"]["left"]["suffix"]["segments"][0]["token_ids"] = [40, 41, 42]  # sure: 2.0
    fresh["arms"]["left"]["answer"] = "9"
    found = judge(recorded, fresh)
    assert found.problems == [] and len(found.near_ties) == 1 and found.after >= 4


def test_a_sampled_trajectory_that_parts_is_counted_not_judged() -> None:
    recorded, fresh = row(), row()
    fresh["arms"]["left"]["suffix"]["segments"][0]["token_ids"][0] = 55  # margin 2.0: sure
    found = judge(recorded, fresh, sampled=True)
    assert found.problems == [] and found.sampled == ["arms.left.suffix.segments[0] at step 0"]
    greedy = judge(recorded, fresh)
    assert greedy.problems


def test_a_near_tie_needs_both_margins_under_the_bound() -> None:
    recorded, fresh = row(), row()
    recorded["arms"]["left"]["suffix"]["segments"][0]["margins"][1] = BOUND + 1
    fresh["arms"]["left"]["suffix"]["segments"][0]["token_ids"][1] = 99
    assert judge(recorded, fresh).problems


def test_owners_and_numeric_fields() -> None:
    assert owner_of("arms.left.suffix.segments[0]") == "arms.left"
    assert owner_of("prefix_stages[0]") == ""
    assert owner_of("samples.live[3].suffix.segments[1]") == "samples.live[3]"
    assert owner_of("rollouts[2].turns[0]") == "rollouts[2]"
    assert numeric("arms.left.cache_fingerprint")
    assert numeric("comparison.per_layer[3].k.max_abs_diff")
    assert numeric("arms.x.served.first_logprobs[0][1]")
    assert not numeric("arms.left.answer") and not numeric("prefix_token_ids[4]")


def test_the_tally_counts_rows_and_lists_near_ties() -> None:
    tally = Tally()
    tally.add("a", None)
    recorded, fresh = row(), row()
    fresh["arms"]["left"]["cache_fingerprint"] = "b" * 64
    tally.add("b", judge(recorded, fresh))
    assert (tally.bitwise, tally.tokens, tally.parted, tally.numerics) == (1, 1, 0, 1)
    assert tally.lines()[0].startswith("across platforms: 1 row(s) equal bit for bit, 1 equal")


@pytest.mark.parametrize(
    ("recorded", "here", "pin"),
    [
        ("AVX2", "AVX512", {PIN: "avx2"}),
        ("DEFAULT", "AVX2", {PIN: "default"}),
        ("AVX512", "AVX2", {}),  # a CPU cannot run a family it lacks
        ("AVX2", "AVX2", {}),
        ("ZVECTOR", "AVX2", {}),
    ],
)
def test_torch_is_pinned_only_down_to_a_family_this_cpu_runs(recorded, here, pin) -> None:
    assert pin_for(recorded, here) == pin


def test_a_platform_is_the_same_only_when_recorded_in_full_and_equal() -> None:
    env = {"cpu_capability": "AVX2"}
    assert meet(env, env, [], 4).same
    assert not meet(env, env, [], 3).same  # scheme 3 recorded no CPU features
    pinned = meet({"cpu_capability": "DEFAULT"}, env, ["cpu_capability"], 4)
    assert pinned.same and pinned.pin == {PIN: "default"}
    other = meet(env, env, ["cpu_features"], 4)
    assert not other.same and "cpu_features" in other.describe()
    assert copy.deepcopy(other) == other
