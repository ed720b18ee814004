"""Answer extraction and the equality/correctness labels of a pair of trajectories.

Mapping of the paper's stage columns onto any plan (docs/experiments/items-and-plans.md):
``trace_equal`` is the first suffix stage (the one the boundary opens), ``merge_equal``
is every suffix stage before the last, and ``answer_equal`` compares extracted answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.trajectory import Trajectory

_INTEGER = re.compile(r"-?\d[\d,]*")
_CHOICE = re.compile(r"\b([A-D])\b")


def extract_integer(text: str) -> str | None:
    """The last integer in the text, commas removed."""
    found = _INTEGER.findall(text)
    return str(int(found[-1].replace(",", ""))) if found else None


def extract_choice(text: str) -> str | None:
    """The last standalone multiple-choice letter A-D (GPQA style)."""
    found = _CHOICE.findall(text)
    return found[-1] if found else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip()
            depth -= 1
    return None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "integer": extract_integer,
    "choice": extract_choice,
    "boxed": extract_boxed,
}


def get_extractor(name: str) -> Callable[[str], str | None]:
    if name not in EXTRACTORS:
        raise KvreplayError(f"Unknown answer extractor {name!r}; choose {', '.join(EXTRACTORS)}.")
    return EXTRACTORS[name]


def normalize(answer: str, extractor: str) -> str:
    """Gold answers go through the same normalisation as extracted ones."""
    if extractor == "integer":
        value = extract_integer(answer)
        return value if value is not None else answer.strip()
    return answer.strip().upper() if extractor == "choice" else answer.strip()


def answer_text(tokenizer: Any, trajectory: Trajectory) -> str:
    """Text of the final stage's decoded tokens (its opener excluded)."""
    final = trajectory.segments[-1]
    return tokenizer.decode(final.token_ids, skip_special_tokens=True)


def score(
    tokenizer: Any, trajectory: Trajectory, gold: str, extractor: str = "integer"
) -> dict[str, Any]:
    """Extracted answer, whether it parsed, and whether it is correct."""
    extracted = get_extractor(extractor)(answer_text(tokenizer, trajectory))
    return {
        "extracted": extracted,
        "parsed": extracted is not None,
        "correct": extracted is not None and extracted == normalize(gold, extractor),
    }


def pair_labels(
    left: Trajectory, right: Trajectory, left_answer: str | None, right_answer: str | None
) -> dict[str, bool]:
    """Stage and answer equality of two continuations of the same plan."""

    def stages_equal(count: int) -> bool:
        return all(
            a.stream == b.stream
            for a, b in zip(left.segments[:count], right.segments[:count], strict=False)
        ) and len(left.segments) == len(right.segments)

    return {
        "suffix_equal": left.token_ids == right.token_ids,
        "trace_equal": stages_equal(1),
        "merge_equal": stages_equal(max(len(left.segments) - 1, 1)),
        "answer_equal": left_answer == right_answer,
    }
