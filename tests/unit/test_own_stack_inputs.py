"""Issue 49, item 5: the bring-your-own-stack API (``audit_own_stack``) validates what it is
handed and what its callables return as the logged-rollouts reader validates a line: one
``KvreplayError`` sentence each, never a value silently truncated or a bare TypeError.
No model: the callables are plain Python."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Sampling
from kvreplay.experiments.rollout import MismatchExpectation, audit_own_stack

SAMPLING = Sampling(max_tokens=4)


def sample_of(tokens: Any, logprobs: Any) -> Callable[..., Any]:
    return lambda prompt, sampling: (tokens, logprobs)


def honest_sample(prompt: list[int], sampling: Sampling) -> tuple[list[int], list[float]]:
    return [5, 6], [-0.5, -0.25]


def honest_score(prompt: list[int], tokens: list[int]) -> list[float]:
    return [-0.5] * len(tokens)


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "more tokens than max_tokens": (
        {"sample": sample_of([1] * 5, [-0.1] * 5)},
        "more than the sampling's max_tokens 4",
    ),
    "a float token id": ({"sample": sample_of([3.7], [-0.1])}, "holds 3.7, not a token id"),
    "a negative token id": ({"sample": sample_of([-1], [-0.1])}, "holds -1, not a token id"),
    "a flag for a token id": ({"sample": sample_of([True], [-0.1])}, "holds True, not a token"),
    "a text token id": ({"sample": sample_of(["3"], [-0.1])}, "holds '3', not a token id"),
    "no token": ({"sample": sample_of([], [])}, "is not a non-empty list of token ids"),
    "a text log-probability": (
        {"sample": sample_of([3], ["-0.1"])},
        "holds '-0.1', not a finite number at most 0",
    ),
    "a positive log-probability": ({"sample": sample_of([3], [0.5])}, "holds 0.5, not a"),
    "a log-probability short": ({"sample": sample_of([3, 4], [-0.1])}, "1 values for 2"),
    "sample returns nothing": ({"sample": lambda p, s: None}, "returned NoneType, not a pair"),
    "sample returns three things": (
        {"sample": lambda p, s: ([1], [-0.1], "x")},
        "returned tuple, not a pair",
    ),
    "sample returns ids alone": ({"sample": sample_of([3], None)}, "is not a list of log-prob"),
    "score returns nothing": ({"score": lambda p, t: None}, "score() returned a result that"),
    "score returns a number": ({"score": lambda p, t: -0.5}, "is not a list of log-prob"),
    "score returns nested lists": ({"score": lambda p, t: [[-0.5], [-0.5]]}, "holds [-0.5]"),
    "score returns a NaN": ({"score": lambda p, t: [math.nan, -0.1]}, "holds nan"),
    "engine_score returns too few": (
        {"engine_score": lambda p, t: [-0.1]},
        "engine_score() returned a result that holds 1",
    ),
    "an empty prompt": ({"prompts": [[]]}, "Prompt 0 is not a non-empty list of token ids"),
    "no prompt": ({"prompts": []}, "needs a non-empty list of prompts"),
    "a float in a prompt": ({"prompts": [[1, 2.5]]}, "Prompt 0 holds 2.5"),
    "a prompt of text": ({"prompts": ["hello"]}, "Prompt 0 is not a non-empty list"),
    "no reports": ({"reports": ()}, "reports must name"),
    "an unknown report": ({"reports": ("logits",)}, "reports must name"),
    "a NaN threshold": (
        {"expectation": lambda: MismatchExpectation(max_k3_kl=math.nan)},
        "max_k3_kl is nan",
    ),
    "a negative threshold": (
        {"expectation": lambda: MismatchExpectation(max_abs_logp=-1.0)},
        "max_abs_logp is -1.0",
    ),
    "the engine's label for the trainer": ({"trainer": "engine"}, "not a label of its own"),
    "the rollout's label for the trainer": ({"trainer": "rollout"}, "not a label of its own"),
    "an empty trainer label": ({"trainer": ""}, "not a label of its own"),
    "a score that is no callable": ({"score": [-0.5]}, "score is a list, not a callable"),
    "zero samples": ({"samples": 0}, "samples must be an integer from 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_the_api_is_handed_is_refused_in_one_sentence(case: str) -> None:
    given, expected = CASES[case]
    with pytest.raises(KvreplayError) as refused:
        made = {k: v() if k == "expectation" else v for k, v in given.items()}
        arguments: dict[str, Any] = {
            "prompts": [[1, 2, 3]], "sample": honest_sample, "score": honest_score,
            "sampling": SAMPLING, "engine_score": honest_score, **made,
        }  # fmt: skip
        audit_own_stack(**arguments)
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


def test_arrays_a_framework_returns_are_taken_as_their_values() -> None:
    result = audit_own_stack(
        np.array([[1, 2, 3]]),
        lambda p, s: (np.array([5, 6]), np.array([-0.5, -0.25], dtype=np.float32)),
        lambda p, t: np.array([-0.5, -0.25]),
        SAMPLING,
    )
    assert result.rows[0]["rollouts"][0]["turns"][0]["token_ids"] == [5, 6]
    assert result.verdict.exit_code == 0
