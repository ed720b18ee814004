"""Bring your own stack (design: rollout stack, scorer, mismatch): the rollout experiment
and its verdict on a pair of callables, for an RL user whose sampler and trainer
kvreplay cannot load (an FSDP or Megatron trainer, a patched engine).

``sample(prompt_ids, sampling)`` returns the token ids it sampled and the
log-probability it reported for each; ``score(prompt_ids, token_ids)`` returns each
token's log-probability after the prompt and the tokens before it, in one
teacher-forced pass. Optionally ``engine_score`` is the sampler's own prefill, which
splits the total into the engine's term and the cross-stack term. The rollouts run
through the experiment's own per-rollout routine
(:func:`kvreplay.experiments.rollout.roll.roll`) into the same rows, the same CSV
lines, the same section claims and the same
:class:`~kvreplay.experiments.rollout.verdict.MismatchVerdict` as ``kvreplay run
rollout`` and ``kvreplay check --trainer``. Nothing is written to disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreplay.backends.rollout import OWN_PREFILL
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import (
    LOGPROB_MODES,
    Conversation,
    Sampling,
    Scored,
    Turn,
    converse,
    ids_problem,
    listed,
    logprobs_problem,
)
from kvreplay.experiments.rollout.claims import GroupClaims
from kvreplay.experiments.rollout.roll import BATCHED, MISS, Bench, roll
from kvreplay.experiments.rollout.schema import MAX_SAMPLES
from kvreplay.experiments.rollout.sides import recorded
from kvreplay.experiments.rollout.table import ROLLOUT, ROLLOUT_SIDE
from kvreplay.experiments.rollout.tally import measure
from kvreplay.experiments.rollout.verdict import MismatchExpectation, MismatchVerdict, judge
from kvreplay.ledger import Record

SampleFn = Callable[[list[int], Sampling], tuple[Sequence[int], Sequence[float]]]
ScoreFn = Callable[[list[int], list[int]], Sequence[float]]
OWN = "own"  # the precision a row of your own stack is filed under
RESERVED = (ROLLOUT_SIDE, OWN_PREFILL, MISS, BATCHED)  # the other sides' labels


@dataclass
class CallableStack:
    """A rollout stack made of a ``sample`` callable: every turn's prompt is handed over
    whole (the callable reuses what it may; kvreplay cannot reset its cache)."""

    sample_fn: SampleFn
    name: str = "sample()"
    batches: bool = False

    def reset_cache(self) -> None:
        """A callable's cache is its own."""

    def sample(self, conversations: Sequence[Conversation], reuse: bool) -> list[list[Turn]]:
        def one(conversation: Conversation) -> list[Turn]:
            def turn(context: list[int]) -> Turn:
                returned = self.sample_fn(context, conversation.sampling)
                return sampled(returned, conversation.sampling.max_tokens)

            return converse(conversation, turn)

        return [one(conversation) for conversation in conversations]


@dataclass
class CallableScorer:
    """A scorer made of a ``score`` callable (it returns only the sampled tokens'
    log-probabilities: no gaps, no argmax)."""

    score_fn: ScoreFn
    name: str = "score()"

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        values = listed(self.score_fn(list(prompt_ids), list(token_ids)))
        problem = logprobs_problem(values, len(token_ids))
        if problem is not None:
            raise KvreplayError(f"{self.name} returned a result that {problem}.")
        return Scored([float(v) for v in values])


def sampled(returned: Any, max_tokens: int) -> Turn:
    """What a ``sample`` callable returned, as a turn: a pair of token ids (at least one,
    at most ``max_tokens``) and one log-probability for each; anything else is refused
    in one sentence, as a logged rollout's line is."""
    if not isinstance(returned, tuple | list) or len(returned) != 2:
        raise KvreplayError(
            f"sample() returned {type(returned).__name__}, not a pair (token ids, "
            "log-probabilities)."
        )
    tokens, logprobs = (listed(part) for part in returned)
    problem = ids_problem(tokens)
    if problem is None and len(tokens) > max_tokens:
        problem = f"holds {len(tokens)} tokens, more than the sampling's max_tokens {max_tokens}"
    if problem is not None:
        raise KvreplayError(f"sample() returned a list of token ids that {problem}.")
    problem = logprobs_problem(logprobs, len(tokens))
    if problem is not None:
        raise KvreplayError(f"sample() returned a list of log-probabilities that {problem}.")
    return Turn([int(t) for t in tokens], [float(v) for v in logprobs])


@dataclass
class OwnStackResult:
    """What the audit of your own stack found: the rows (as a run records them), the
    verdict, and the section's claims."""

    rows: list[dict[str, Any]]
    verdict: MismatchVerdict
    claims: dict[str, GroupClaims] = field(default_factory=dict)


def audit_own_stack(
    prompts: Sequence[Sequence[int]],
    sample: SampleFn,
    score: ScoreFn,
    sampling: Sampling,
    reports: tuple[str, ...] = ("raw",),
    engine_score: ScoreFn | None = None,
    expectation: MismatchExpectation | None = None,
    trainer: str = "trainer",
    samples: int = 1,
) -> OwnStackResult:
    """Sample ``samples`` rollouts of each prompt (seeds ``sampling.seed`` on), score them
    with ``score`` (and ``engine_score``), and judge the pair against ``expectation``
    (the k3 KL at most 1e-3 by default). ``reports`` says which log-probabilities
    ``sample`` returns (raw, processed): settings under which they would be ambiguous
    are refused, as the CLI refuses them."""
    check_request(prompts, sample, score, engine_score, reports, trainer, samples)
    sampling.check(reports, "sample()")
    scorers: list[tuple[str, Any]] = [(trainer, CallableScorer(score))]
    if engine_score is not None:
        scorers.insert(0, (OWN_PREFILL, CallableScorer(engine_score, "engine_score()")))
    bench = Bench(CallableStack(sample), scorers)
    rows = []
    for index, prompt in enumerate(listed(prompts)):
        ids = [int(t) for t in listed(prompt)]
        rollouts = [
            roll(bench, Conversation(tuple(ids), (), sampling.seeded(seed)))
            for seed in range(sampling.seed, sampling.seed + samples)
        ]
        rows.append(
            {
                "item_id": f"p{index:04d}",
                "precision": OWN,
                "status": "ok",
                "temperature": sampling.temperature,
                "prompt_token_ids": ids,
                "rollouts": rollouts,
            }
        )
    records = [
        Record(i, f"{ROLLOUT}/{row['item_id']}/{OWN}", ROLLOUT, row, OWN, {}, "", "", "")
        for i, row in enumerate(rows)
    ]  # kept in memory, so unchained
    measured = measure(recorded(records, {}), trainer)
    verdict = judge(measured, trainer, expectation or MismatchExpectation(), "sample()")
    return OwnStackResult(rows, verdict, verdict.claims)


def check_request(
    prompts: Any, sample: Any, score: Any, engine_score: Any, reports: Any, trainer: Any,
    samples: Any,
) -> None:  # fmt: skip
    """Refuse (one sentence each) what the caller handed over before any callable runs:
    prompts that are not non-empty lists of token ids, callables that are not callable,
    ``reports`` that name no log-probability mode or an unknown one, a trainer label
    that is another side's, a sample count out of bounds (an expectation checks its own
    bounds)."""
    listed_prompts = listed(prompts)
    if not isinstance(listed_prompts, list) or not listed_prompts:
        raise KvreplayError("audit_own_stack needs a non-empty list of prompts (token id lists).")
    for index, prompt in enumerate(listed_prompts):
        problem = ids_problem(prompt)
        if problem is not None:
            raise KvreplayError(f"Prompt {index} {problem}.")
    for name, given in (("sample", sample), ("score", score), ("engine_score", engine_score)):
        if not callable(given) and not (name == "engine_score" and given is None):
            raise KvreplayError(f"{name} is a {type(given).__name__}, not a callable.")
    if (
        not isinstance(reports, tuple | list)
        or not reports
        or not set(reports) <= set(LOGPROB_MODES)
    ):
        raise KvreplayError(
            f"reports must name the log-probabilities sample() returns: one or both of "
            f"{', '.join(LOGPROB_MODES)}; got {str(reports)[:40]!r}."
        )
    if not isinstance(trainer, str) or not trainer.strip() or trainer in RESERVED:
        raise KvreplayError(
            f"trainer {str(trainer)[:40]!r} is not a label of its own (a non-empty name other "
            f"than {', '.join(RESERVED)})."
        )
    if isinstance(samples, bool) or not isinstance(samples, int) or not 0 < samples <= MAX_SAMPLES:
        raise KvreplayError(f"samples must be an integer from 1 to {MAX_SAMPLES}; got {samples!r}.")
