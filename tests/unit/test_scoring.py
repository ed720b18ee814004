"""Answer extraction, correctness, and equality labels of two continuations."""

from __future__ import annotations

import pytest
import tiny

from kvreplay import KvreplayError, Trajectory
from kvreplay.core.scoring import (
    extract_boxed,
    extract_choice,
    extract_integer,
    get_extractor,
    normalize,
    pair_labels,
    score,
)
from kvreplay.model.decode import Segment


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("3 apples, then 1,250 and finally -7", "-7"),
        ("total: 1,250", "1250"),
        ("007", "7"),
        ("no digits here", None),
    ],
)
def test_extract_integer(text: str, expected: str | None) -> None:
    assert extract_integer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("I think (B), no wait, C", "C"), ("Answer: D", "D"), ("ABCD", None), ("E", None)],
)
def test_extract_choice(text: str, expected: str | None) -> None:
    assert extract_choice(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{12}", "12"),
        ("\\boxed{1} then \\boxed{ \\frac{1}{2} }", "\\frac{1}{2}"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("\\boxed{unclosed {", None),
        ("nothing boxed", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_unknown_extractor_is_refused() -> None:
    with pytest.raises(KvreplayError, match="integer"):
        get_extractor("regex")


@pytest.mark.parametrize(
    ("gold", "extractor", "expected"),
    [("1,000", "integer", "1000"), (" b ", "choice", "B"), (" x ", "boxed", "x")],
)
def test_gold_answers_are_normalised_like_extracted_ones(gold, extractor, expected) -> None:
    assert normalize(gold, extractor) == expected


def _trajectory(tokenizer, *stages: tuple[str, str, str]) -> Trajectory:
    return Trajectory(
        [
            Segment(name, tokenizer.encode(opener), tokenizer.encode(text), "cap")
            for name, opener, text in stages
        ]
    )


def test_score_reads_the_final_stage_without_its_opener() -> None:
    tokenizer = tiny.byte_tokenizer()
    right = _trajectory(tokenizer, ("trace", "", "so 3 + 4 = 7"), ("answer", " 99:", " 7"))
    assert score(tokenizer, right, "7") == {"extracted": "7", "parsed": True, "correct": True}
    wrong = _trajectory(tokenizer, ("trace", "", "7"), ("answer", "", " eight"))
    assert score(tokenizer, wrong, "7") == {"extracted": None, "parsed": False, "correct": False}


def test_pair_labels() -> None:
    tokenizer = tiny.byte_tokenizer()
    a = _trajectory(tokenizer, ("trace", "", "abc"), ("merge", "", "d"), ("answer", ":", "1"))
    same_trace = _trajectory(
        tokenizer, ("trace", "", "abc"), ("merge", "", "e"), ("answer", ":", "1")
    )
    assert pair_labels(a, a, "1", "1") == {
        "suffix_equal": True,
        "trace_equal": True,
        "merge_equal": True,
        "answer_equal": True,
    }
    assert pair_labels(a, same_trace, "1", "2") == {
        "suffix_equal": False,
        "trace_equal": True,
        "merge_equal": False,
        "answer_equal": False,
    }
