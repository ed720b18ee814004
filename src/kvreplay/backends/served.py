"""What a served backend exchanges with the experiments: a request (one stage from a
context of token ids), what it serves back (the stage's tokens, the cached prompt tokens
the server reported, each step's top logprobs), and the served-model interface every
backend without K/V access implements (reset its prefix cache, serve requests together).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvreplay.stages import Stage

if TYPE_CHECKING:  # decode imports torch; a backend's settings must not
    from kvreplay.decode import Sampler, Segment

TOP_LOGPROBS = 2


@dataclass(frozen=True)
class Request:
    """One stage served from a context: token ids in, the stage's tokens out."""

    context: list[int]  # ends with the stage's forced opener, if any
    stage: Stage
    sampler: Sampler
    opener: tuple[int, ...] = ()  # recorded in the segment


@dataclass
class Served:
    """A served stage: its segment, the cached context tokens the engine reported, and
    each step's top logprobs (token id, logprob), best first: the top two and the
    sampled token."""

    segment: Segment
    cached_tokens: int
    steps: list[list[tuple[int, float]]]


class ServedModel(Protocol):
    """A model behind a serving engine, for one precision."""

    context_length: int

    def reset_cache(self) -> None:
        """Drop every prefix-cache block, so that the next request is a miss."""

    def serve(self, requests: Sequence[Request]) -> list[Served]:
        """Serve requests together, so that they may share batches."""


def logprobs_fingerprint(first_logprobs: list[tuple[int, float]]) -> str:
    """sha256 of a step's top logprobs, exact to the bit (floats as their hex)."""
    text = json.dumps([[t, float(lp).hex()] for t, lp in first_logprobs])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
