"""What a served backend exchanges with the experiments: a request (one stage from a
context of token ids), its reply (the stage's tokens, the cached prompt tokens the server
reported, each step's top logprobs), and the served-model interface every
backend without K/V access implements (reset its prefix cache, serve requests together).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvreplay.core.errors import KvreplayError
from kvreplay.core.stages import Stage
from kvreplay.core.trajectory import step_digest

if TYPE_CHECKING:  # decode imports torch; a backend's settings must not
    from kvreplay.backends.traffic import Traffic
    from kvreplay.core.sampler import Sampler
    from kvreplay.core.stages import StopDetector
    from kvreplay.core.trajectory import Segment

TOP_LOGPROBS = 2


@dataclass(frozen=True)
class Request:
    """One stage served from a context: token ids in, the stage's tokens out."""

    context: list[int]  # ends with the stage's forced opener, if any
    stage: Stage
    sampler: Sampler
    opener: tuple[int, ...] = ()  # recorded in the segment
    salt: str | None = None  # the request's cache_salt: only requests of one salt share blocks


@dataclass(frozen=True)
class Sampled:
    """A completion sampled for a rollout, as a server reported it: its tokens, the
    log-probability of each, the top-1/top-2 gap at each step, why it stopped (the
    server's word) and the cached prompt tokens."""

    tokens: list[int]
    logprobs: list[float]
    margins: list[float]
    finish: str | None
    cached_tokens: int


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
    block_size: int  # tokens per cached block (1: the engine reuses any common prefix)
    vocabulary: int  # token ids the model has
    salts: bool  # whether a request's salt keeps its cached blocks from other salts'

    def reset_cache(self) -> None:
        """Drop every prefix-cache block, so that the next request is a miss."""

    def round_trip(self) -> None:
        """Save the state the arm's requests left in the engine and load it back in its
        place, so that the next request continues from a copy of the live state."""

    def serve(self, requests: Sequence[Request]) -> list[Reply]:
        """Serve requests together, so that they may share batches."""

    def traffic(self, clients: int, seed: str, prompts: Sequence[list[int]]) -> Traffic:
        """Background traffic for the duration of a ``with`` block (a server backend)."""

    def evict(self, computed: int, seed: str) -> int:
        """Send unrelated prompts that overwrite part of the ``computed`` tokens of P the
        arm's requests wrote; the tokens sent."""

    def pool_tokens(self) -> int | None:
        """Tokens the engine's K/V pool holds for requests (None: it does not say, or it
        keeps each request's K/V apart, as llama-server's slots do)."""

    def preemptions(self) -> float | None:
        """Requests the engine has preempted since it started (None: it does not say)."""


@dataclass(frozen=True)
class Completion:
    """Why a server says it stopped: ``finish_reason`` ("stop" at a stop string or
    token, "length" at the request's cap)."""

    finish_reason: str | None


def check_answer(
    request: Request,
    tokens: list[int],
    steps: list[list[tuple[int, float]]],
    cached_tokens: int,
    server: str,
    vocabulary: int,
) -> None:
    """Refuse (one sentence naming the server) an answer that cannot be the request's:
    more tokens than the stage's cap, a token or logprob id outside the model's
    vocabulary, a step without its top logprobs or with a logprob that is not a finite
    number at most 0, a greedy token its own step's logprobs do not rank first, or more
    cached prompt tokens than the request sent."""
    stage, cap = request.stage.name, request.stage.max_new_tokens
    if len(tokens) > cap:
        raise KvreplayError(
            f"{server} returned {len(tokens)} tokens for the stage {stage}, whose cap is {cap}."
        )
    if len(steps) != len(tokens):
        raise KvreplayError(
            f"{server} returned {len(tokens)} tokens but top logprobs for {len(steps)} steps."
        )
    if any(len(step) < TOP_LOGPROBS for step in steps):
        raise KvreplayError(f"{server} returned fewer than two logprobs for a step.")
    ids = [*tokens, *(token for step in steps for token, _ in step)]
    outside = next((t for t in ids if not 0 <= t < vocabulary), None)
    if outside is not None:
        raise KvreplayError(
            f"{server} returned the token id {outside}, outside the model's vocabulary of "
            f"{vocabulary}."
        )
    if not all(math.isfinite(lp) and lp <= 0 for step in steps for _, lp in step):
        raise KvreplayError(f"{server} returned a logprob that is not a finite number at most 0.")
    if request.sampler.greedy:
        index = next((i for i, t in enumerate(tokens) if not _best(t, steps[i])), None)
        if index is not None:
            raise KvreplayError(
                f"{server} returned the token {tokens[index]} at step {index} of a greedy "
                "request, but its logprobs rank another token above it."
            )
    if not 0 <= cached_tokens <= len(request.context):
        raise KvreplayError(
            f"{server} reported {cached_tokens} cached prompt tokens for a prompt of "
            f"{len(request.context)}."
        )


def _best(token: int, step: list[tuple[int, float]]) -> bool:
    """Whether ``token`` has the highest logprob of its step (a tie included)."""
    return any(t == token and lp == max(x for _, x in step) for t, lp in step)


def served_stage(
    request: Request,
    tokens: list[int],
    steps: list[list[tuple[int, float]]],
    completion: Completion,
    cached_tokens: int,
    detector: StopDetector,
    server: str,
    vocabulary: int,
) -> Reply:
    """A served stage as the hf backend would record it: cut where the plan's stop rule
    (:class:`~kvreplay.core.stages.StopDetector`) first fires, the reason named, and each
    step's top-1/top-2 logprob difference as its margin. The answer is checked against
    its request first (:func:`check_answer`), and a stage the stop rule did not end must
    have run to its cap, as the server must say: a server that stops short without a
    stop string or EOS token in its tokens, or claims a stop it did not make, is refused."""
    from kvreplay.core.trajectory import Segment

    check_answer(request, tokens, steps, cached_tokens, server, vocabulary)
    reason = "cap"
    for end in range(1, len(tokens) + 1):
        hit = detector.hit(tokens[:end])
        if hit is not None:
            tokens, steps, reason = tokens[:end], steps[:end], hit
            break
    cap = request.stage.max_new_tokens
    if reason == "cap" and (len(tokens) < cap or completion.finish_reason != "length"):
        raise KvreplayError(
            f"{server} returned {len(tokens)} tokens for the stage {request.stage.name} (cap "
            f"{cap}) and says it finished by {completion.finish_reason!r:.40}, but no stop "
            "string or EOS token of the stage ends them."
        )
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
