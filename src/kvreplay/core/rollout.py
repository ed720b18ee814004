"""Rollouts as the rollout experiment records them (design: rollout stack, scorer,
mismatch): how a rollout stack samples, which log-probability it reports, a sampled
turn with the log-probability of each token it took, and a scorer's teacher-forced
log-probabilities of those tokens. Plain data, no torch: the table, the analysis, the
gate and the bring-your-own-stack API read it without loading a model.

Which log-probability (design: mismatch). A sampler turns logits into a distribution in
steps: divide by the temperature, keep the top k, keep the nucleus of mass top-p. A
*raw* log-probability is the log-softmax of the logits before any of that (vLLM's
``logprobs_mode=raw_logprobs``; llama-server without ``post_sampling_probs``; what
kvreplay computes from transformers' and llama.cpp's logits); a *processed* one is the
log of the probability the token had in the distribution actually sampled from
(vLLM's ``processed_logprobs``). At temperature 1 with no truncation they are the same
number. Elsewhere a comparison is ambiguous unless both sides say which one they hold,
and some settings leave no unambiguous processed value at all: :meth:`Sampling.check`
refuses those in one sentence.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.core.errors import KvreplayError

LOGPROB_MODES = ("raw", "processed")
LOGPROB_FLOOR = -3.4028234663852886e38
"""The least log-probability taken: the least float32, below what any sampler or scorer
in float32, bfloat16 or float16 writes; a value past it (-1e308) is a forgery, and would
overflow the mismatch's sums into numbers no gate can judge."""


@dataclass(frozen=True)
class Sampling:
    """How a rollout stack samples one turn (seeded; top-k 0 means no top-k) and which
    log-probability it must report (``logprobs``: raw or processed)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: str = "raw"
    max_tokens: int = 128
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-p or top-k cut the distribution sampled from."""
        return self.top_p < 1 or self.top_k > 0

    @property
    def processed_is_raw(self) -> bool:
        """Whether the processed log-probability is the raw one at these settings: at
        temperature 1 with no truncation the sampler's distribution is the model's."""
        return self.temperature == 1 and not self.truncates

    def check(self, reports: tuple[str, ...], stack: str) -> None:
        """Refuse (one sentence) settings under which the reported log-probabilities are
        ambiguous: a processed value at temperature 0 (a point mass) or under truncation
        (it depends on a cut the scorer's own prefill does not make), or a stack that
        cannot say it reports the mode asked for where raw and processed differ."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise KvreplayError("--temperature must be a finite number of at least 0.")
        if not 0 < self.top_p <= 1:
            raise KvreplayError("--top-p must lie in (0, 1].")
        if self.top_k < 0:
            raise KvreplayError("--top-k must be 0 (off) or a positive number of tokens.")
        if self.max_tokens < 1:
            raise KvreplayError("--max-tokens must be at least 1.")
        if self.logprobs not in LOGPROB_MODES:
            raise KvreplayError(
                f"--logprobs must be one of {', '.join(LOGPROB_MODES)}; got {self.logprobs!r}."
            )
        if self.logprobs == "processed" and self.greedy:
            raise KvreplayError(
                "At --temperature 0 the sampler's processed distribution is a point mass, so "
                "a processed log-probability is 0 or -inf whatever the model computed; "
                "use --logprobs raw."
            )
        if self.logprobs == "processed" and self.truncates:
            raise KvreplayError(
                "Under top-p or top-k truncation a processed log-probability depends on "
                "which tokens the cut kept, which a scorer's own prefill need not keep, so "
                "the comparison is ambiguous; use --logprobs raw or turn truncation off."
            )
        if self.logprobs not in reports and not self.processed_is_raw:
            said = " or ".join(reports) if reports else "neither"
            raise KvreplayError(
                f"The rollout stack {stack} reports {said} log-probabilities, not "
                f"{self.logprobs} ones, and at --temperature {self.temperature:g} with "
                f"top-p {self.top_p:g} and top-k {self.top_k} the two differ, so its numbers "
                "would be ambiguous; use --temperature 1 without truncation or --logprobs "
                f"{' or '.join(reports) or 'raw'}."
            )

    def seeded(self, seed: int) -> Sampling:
        return Sampling(**{**asdict(self), "seed": seed})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Conversation:
    """One rollout: its first prompt's token ids and, for each later turn, the ids that
    follow the previous turn's answer (the end of that turn, the next user message, the
    start of the next answer). Turn k's prompt is the previous turn's prompt, its answer
    and the k-th follow-up, token for token, as a framework that re-sends ids does."""

    prompt_ids: tuple[int, ...]
    followups: tuple[tuple[int, ...], ...] = ()
    sampling: Sampling = field(default_factory=Sampling)

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


@dataclass(frozen=True)
class Turn:
    """One sampled turn as the rollout stack reported it: the tokens it took, the
    log-probability of each (the mode the sampling names), the top-1/top-2
    log-probability gap at each step where the stack reports it, the prompt tokens it
    served from its prefix cache (None: it does not say), and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    margins: list[float] | None = None
    cached_tokens: int | None = None
    finish: str = "length"

    def __post_init__(self) -> None:
        check_logprobs(self.logprobs, len(self.token_ids), "the rollout stack")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
        return cls(**data)


@dataclass(frozen=True)
class Scored:
    """A scorer's teacher-forced pass over a prompt and the tokens sampled after it:
    each position's log-probability of the sampled token (raw), the top-1/top-2
    log-probability gap there, and the positions whose argmax is another token (as
    ``[position, argmax]`` pairs: at temperature 0 the first is where the scorer would
    have decoded otherwise). A scorer that reports only the sampled tokens' values (a
    callable of your own) leaves the gaps and the argmax out (None)."""

    logprobs: list[float]
    margins: list[float] | None = None
    argmax_differs: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.margins is not None and len(self.margins) != len(self.logprobs):
            raise KvreplayError(
                f"A scorer returned {len(self.margins)} top-1/top-2 gaps for "
                f"{len(self.logprobs)} log-probabilities."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scored:
        return cls(**data)


def listed(value: Any) -> Any:
    """A sequence as a list (an array's or a tensor's ``tolist()``); anything else as is."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value) if isinstance(value, tuple) else value


def ids_problem(ids: Any) -> str | None:
    """Why ``ids`` is not a non-empty list of token ids (integers of at least 0, not
    flags, not floats), or None."""
    ids = listed(ids)
    if not isinstance(ids, list) or not ids:
        return "is not a non-empty list of token ids"
    bad = [t for t in ids if not _integer(t) or t < 0][:1]
    if bad:
        return f"holds {repr(bad[0])[:20]}, not a token id (an integer of at least 0)"
    return None


def logprobs_problem(values: Any, tokens: int) -> str | None:
    """Why ``values`` are not one log-probability per token (numbers, not flags or
    text, each at most 0 and at least :data:`LOGPROB_FLOOR`), or None."""
    values = listed(values)
    if not isinstance(values, list):
        return "is not a list of log-probabilities"
    if len(values) != tokens:
        return f"holds {len(values)} values for {tokens} tokens"
    bad = [v for v in values if not _real(v) or not LOGPROB_FLOOR <= v <= 0][:1]
    if bad:
        return (
            f"holds {repr(bad[0])[:20]}, not a finite number at most 0 and at least "
            f"{LOGPROB_FLOOR:.4g} (a log-probability a float32 holds)"
        )
    return None


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def converse(
    conversation: Conversation,
    turn: Callable[[list[int]], Turn],
    between: Callable[[], None] | None = None,
) -> list[Turn]:
    """A conversation's turns sampled one after another by ``turn`` (given each turn's
    whole prompt: the previous prompt, its answer and the follow-up, token for token);
    ``between`` runs before each later turn (a cache reset, where nothing is reused)."""
    context, turns = list(conversation.prompt_ids), []
    for index in range(conversation.turns):
        if index:
            context += [*turns[-1].token_ids, *conversation.followups[index - 1]]
            if between is not None:
                between()
        turns.append(turn(list(context)))
    return turns


def check_logprobs(logprobs: list[float], tokens: int, who: str) -> None:
    """Refuse (one sentence) log-probabilities that cannot be a token's: a count other
    than the tokens', or a value that is not a finite number at most 0."""
    problem = logprobs_problem(logprobs, tokens)
    if problem is not None:
        raise KvreplayError(
            f"{who[0].upper()}{who[1:]} returned a list of log-probabilities that {problem}."
        )


def common_length(left: list[int], right: list[int]) -> int:
    """How many leading tokens two samples share: where two arms drew the same seed,
    their log-probabilities are of the same tokens up to there, and comparable."""
    count = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        count += 1
    return count
