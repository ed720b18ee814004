"""Stage plans and stop detection."""

from __future__ import annotations

import pytest
import tiny

from kvreplay import KvreplayError, StagePlan, get_plan
from kvreplay.core.stages import BUILTIN_PLANS, Stage, StopDetector


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.byte_tokenizer()


def test_builtin_instruct_plan_leaves_a_long_suffix() -> None:
    plan = get_plan("instruct")
    assert plan.stages[plan.boundary].name == "think"
    assert sum(s.max_new_tokens for s in plan.suffix_stages) >= 80
    assert plan.suffix_stages[-1].opener


def test_reasoning_plan_cuts_at_the_end_of_thinking() -> None:
    plan = get_plan("reasoning")
    assert [s.name for s in plan.stages] == ["think", "answer"]
    assert plan.prefix_stages[0].stop == ("</think>",)


def test_unknown_plan_names_the_choices() -> None:
    with pytest.raises(KvreplayError, match="instruct"):
        get_plan("nope")


@pytest.mark.parametrize("name", sorted(BUILTIN_PLANS))
def test_plans_round_trip_through_a_dict(name: str) -> None:
    plan = get_plan(name)
    data = plan.to_dict()
    assert data["boundary_stage"] == plan.stages[plan.boundary].name
    assert StagePlan.from_dict(data) == plan


def test_prefix_and_suffix_stages_split_at_the_boundary() -> None:
    stages = tuple(Stage(n, 4) for n in "abcd")
    plan = StagePlan("p", stages, boundary=1)
    assert [s.name for s in plan.prefix_stages] == ["a", "b"]
    assert [s.name for s in plan.suffix_stages] == ["c", "d"]


@pytest.mark.parametrize(
    ("stages", "boundary", "message"),
    [
        ((), 0, "at least one stage"),
        ((Stage("a", 4),), 0, "boundary"),
        ((Stage("a", 4), Stage("b", 4)), 1, "boundary"),
        ((Stage("a", 4), Stage("b", 4)), -1, "boundary"),
        ((Stage("a", 4), Stage("a", 4)), 0, "unique"),
    ],
)
def test_invalid_plans_are_refused(stages, boundary: int, message: str) -> None:
    with pytest.raises(KvreplayError, match=message):
        StagePlan("bad", stages, boundary)


def _run_stage(detector: StopDetector, stream: list[int]) -> tuple[list[int], list[str]]:
    """Feed ``stream`` token by token the way a stage does; stop at the first hit."""
    tokens: list[int] = []
    hits: list[str] = []
    for token in stream:
        tokens.append(token)
        if (hit := detector.hit(tokens)) is not None:
            hits.append(hit)
            break
    return tokens, hits


@pytest.mark.parametrize("stop", ["</think>", "\n\n", "Answer:"])
def test_stop_spanning_tokens_fires_exactly_once_on_its_last_token(tokenizer, stop: str) -> None:
    head = tokenizer.encode(f"some thinking{stop}", add_special_tokens=False)
    stream = head + tokenizer.encode(f"more text{stop}", add_special_tokens=False)
    assert len(tokenizer.encode(stop, add_special_tokens=False)) == len(stop) > 1
    tokens, hits = _run_stage(StopDetector(tokenizer, (stop,)), stream)
    assert tokens == head
    assert hits == [f"stop:{stop}"]


def test_stop_inside_a_long_stage_is_found_with_a_constant_window(tokenizer) -> None:
    ids = tokenizer.encode("x" * 500 + "</think>", add_special_tokens=False)
    detector = StopDetector(tokenizer, ("</think>",))
    assert detector.hit(ids) == "stop:</think>"
    assert detector.hit(ids[:-1]) is None


def test_eos_token_ends_a_stage(tokenizer) -> None:
    detector = StopDetector(tokenizer, (), frozenset({256}))
    assert detector.hit([65, 256]) == "eos"
    assert detector.hit([65, 66]) is None
    assert detector.hit([]) is None
