"""One rollout and everything the audit measures on it (design: rollout stack, scorer,
mismatch): the rollout stack samples a conversation's turns (a later turn's prompt
served from what the earlier turns computed: a prefix-cache hit), each scorer
teacher-forces every turn's sampled tokens after that turn's whole prompt, and two
controls show what the stack's own path contributed: each later turn sampled again from
a cold cache (a *miss*), and the first turn sampled again in a batch with other
items' conversations (*batched*). A control draws the same seed, so its tokens are the
rollout's until the first flip, and are compared up to there.

The record is plain data (:func:`roll` returns a row's ``rollouts`` entry); the rollout
experiment runs it per item and seed, and the bring-your-own-stack API on callables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvreplay.backends.roles import RolloutStack, Scorer
from kvreplay.core.rollout import Conversation, Turn

MISS, BATCHED = "miss", "batched"
"""The controls' names, as rows and the CSV spell them."""


@dataclass(frozen=True)
class Bench:
    """A unit's stack and scorers by label (the engine's own prefill first, where the
    stack has one), and the conversations that share the batched control's batch."""

    stack: RolloutStack
    scorers: Sequence[tuple[str, Scorer]]
    companions: Sequence[Conversation] = ()


def contexts(conversation: Conversation, turns: Sequence[Turn]) -> list[list[int]]:
    """Each turn's whole prompt: the first prompt, then the previous prompt, its answer
    and the follow-up, token for token."""
    found = [list(conversation.prompt_ids)]
    for turn, followup in zip(turns, conversation.followups, strict=False):
        found.append([*found[-1], *turn.token_ids, *followup])
    return found


def roll(bench: Bench, conversation: Conversation, clock: Any = None) -> dict[str, Any]:
    """One rollout of ``conversation`` (its sampling's seed) as a row records it: each
    turn sampled with reuse after a cache reset, every scorer's pass over it, and the
    controls. ``clock`` (a :class:`~kvreplay.harness.units.Clock`) counts model time."""
    stack = bench.stack
    model = clock.model if clock is not None else contextlib.nullcontext
    with model():
        stack.reset_cache()
        turns = stack.sample([conversation], reuse=True)[0]
    records = []
    for index, (turn, context) in enumerate(zip(turns, contexts(conversation, turns), strict=True)):
        record: dict[str, Any] = turn.to_dict()
        if index:
            record["followup_token_ids"] = list(conversation.followups[index - 1])
        with model():
            record["scores"] = {
                label: scorer.score(context, turn.token_ids).to_dict()
                for label, scorer in bench.scorers
            }
            controls = {}
            if index:
                alone = Conversation(tuple(context), (), conversation.sampling)
                stack.reset_cache()
                controls[MISS] = stack.sample([alone], reuse=False)[0][0].to_dict()
            elif stack.batches and bench.companions:
                first = Conversation(conversation.prompt_ids, (), conversation.sampling)
                stack.reset_cache()
                batch = stack.sample([first, *bench.companions], reuse=True)
                controls[BATCHED] = batch[0][0].to_dict()
        if controls:
            record["controls"] = controls
        records.append(record)
    return {"seed": conversation.sampling.seed, "turns": records}
