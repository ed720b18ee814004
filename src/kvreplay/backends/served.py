"""What a served backend exchanges with the experiments: a request (one stage from a
context of token ids), its reply (the stage's tokens, the cached prompt tokens the server
reported, each step's top logprobs), and the served-model interface every
backend without K/V access implements (reset its prefix cache, serve requests together).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvreplay.errors import KvreplayError
from kvreplay.stages import Stage
from kvreplay.trajectory import step_digest

if TYPE_CHECKING:  # decode imports torch; a backend's settings must not
    from kvreplay.sampler import Sampler
    from kvreplay.stages import StopDetector
    from kvreplay.trajectory import Segment

TOP_LOGPROBS = 2


@dataclass(frozen=True)
class Request:
    """One stage served from a context: token ids in, the stage's tokens out."""

    context: list[int]  # ends with the stage's forced opener, if any
    stage: Stage
    sampler: Sampler
    opener: tuple[int, ...] = ()  # recorded in the segment


@dataclass
class Reply:
    """A request's reply, the stage as served: its segment, the cached context tokens the
    engine reported, and each step's top logprobs (token id, logprob), best first: the
    top two and the sampled token."""

    segment: Segment
    cached_tokens: int
    steps: list[list[tuple[int, float]]]


class ServedModel(Protocol):
    """A model behind a serving engine, for one precision."""

    context_length: int
    restores: bool  # whether round_trip works: the hit's replica is then a restored state

    def reset_cache(self) -> None:
        """Drop every prefix-cache block, so that the next request is a miss."""

    def round_trip(self) -> None:
        """Save the state the arm's requests left in the engine and load it back in its
        place, so that the next request continues from a copy of the live state."""

    def serve(self, requests: Sequence[Request]) -> list[Reply]:
        """Serve requests together, so that they may share batches."""


@dataclass(frozen=True)
class Completion:
    """Why a server says it stopped: ``finish_reason`` ("stop", "length") and the stop
    string or token it saw (None for EOS)."""

    finish_reason: str | None
    stop_reason: str | int | None = None


def served_stage(
    request: Request,
    tokens: list[int],
    steps: list[list[tuple[int, float]]],
    completion: Completion,
    cached_tokens: int,
    detector: StopDetector,
    server: str,
) -> Reply:
    """A served stage as the hf backend would record it: cut where the plan's stop rule
    (:class:`~kvreplay.stages.StopDetector`) first fires, the reason named, and each
    step's top-1/top-2 logprob difference as its margin."""
    from kvreplay.trajectory import Segment

    reason = "cap"
    for end in range(1, len(tokens) + 1):
        hit = detector.hit(tokens[:end])
        if hit is not None:
            tokens, steps, reason = tokens[:end], steps[:end], hit
            break
    if reason == "cap" and completion.finish_reason == "stop":  # the server saw a stop
        stop = completion.stop_reason
        reason = f"stop:{stop}" if isinstance(stop, str) else "eos"
    if len(steps) != len(tokens) or any(len(step) < TOP_LOGPROBS for step in steps):
        raise KvreplayError(f"{server} returned fewer than two logprobs for a step.")
    margins = [step[0][1] - step[1][1] for step in steps]
    digests = [step_digest(logprobs_fingerprint(step)) for step in steps]
    return Reply(
        Segment(request.stage.name, list(request.opener), tokens, reason, margins, digests),
        cached_tokens,
        steps,
    )


def logprobs_fingerprint(first_logprobs: Sequence[Sequence[Any]]) -> str:
    """sha256 of a step's top logprobs, exact to the bit (floats as their hex)."""
    text = json.dumps([[t, float(lp).hex()] for t, lp in first_logprobs])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
