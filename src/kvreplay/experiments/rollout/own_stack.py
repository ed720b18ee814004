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

from kvreplay.backends.rollout import ENGINE
from kvreplay.core.rollout import (
    Conversation,
    Sampling,
    Scored,
    Turn,
    check_logprobs,
    converse,
)
from kvreplay.experiments.rollout.roll import Bench, roll
from kvreplay.experiments.rollout.sides import recorded
from kvreplay.experiments.rollout.table import ROLLOUT
from kvreplay.experiments.rollout.tally import measure
from kvreplay.experiments.rollout.verdict import MismatchExpectation, MismatchVerdict, judge
from kvreplay.ledger import Record

SampleFn = Callable[[list[int], Sampling], tuple[Sequence[int], Sequence[float]]]
ScoreFn = Callable[[list[int], list[int]], Sequence[float]]
OWN = "own"  # the precision a row of your own stack is filed under


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
                tokens, logprobs = self.sample_fn(context, conversation.sampling)
                return Turn([int(t) for t in tokens], [float(v) for v in logprobs])

            return converse(conversation, turn)

        return [one(conversation) for conversation in conversations]


@dataclass
class CallableScorer:
    """A scorer made of a ``score`` callable (it returns only the sampled tokens'
    log-probabilities: no gaps, no argmax)."""

    score_fn: ScoreFn
    name: str = "score()"

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        values = [float(v) for v in self.score_fn(list(prompt_ids), list(token_ids))]
        check_logprobs(values, len(token_ids), "the score callable")
        return Scored(values)


@dataclass
class OwnStackResult:
    """What the audit of your own stack found: the rows (as a run records them), the
    verdict, and the section's claims."""

    rows: list[dict[str, Any]]
    verdict: MismatchVerdict
    claims: dict[str, Any] = field(default_factory=dict)


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
    sampling.check(reports, "sample()")
    scorers: list[tuple[str, Any]] = [(trainer, CallableScorer(score))]
    if engine_score is not None:
        scorers.insert(0, (ENGINE, CallableScorer(engine_score)))
    bench = Bench(CallableStack(sample), scorers)
    rows = []
    for index, prompt in enumerate(prompts):
        rollouts = [
            roll(bench, Conversation(tuple(int(t) for t in prompt), (), sampling.seeded(seed)))
            for seed in range(sampling.seed, sampling.seed + samples)
        ]
        rows.append(
            {
                "item_id": f"p{index:04d}",
                "precision": OWN,
                "status": "ok",
                "temperature": sampling.temperature,
                "prompt_token_ids": [int(t) for t in prompt],
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
