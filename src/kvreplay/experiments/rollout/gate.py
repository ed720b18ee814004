"""The rollout experiment's gate (design: check, mismatch): ``kvreplay check --trainer
SPEC`` runs a small rollout run with the backend under test as the rollout stack and
``SPEC`` as the trainer (``--n`` items, one rollout each, scored by the stack's own
prefill and by the trainer), and this gate judges its rows
(:func:`~kvreplay.experiments.rollout.verdict.judge`). Its own options are the
expectation's bounds (:class:`~kvreplay.experiments.rollout.verdict.MismatchBounds`) and
the rollout options a check takes (:data:`TAKEN`); ``--expect bitwise`` asks for the bits
level. The check reaches it through the experiment's declaration."""

from __future__ import annotations

import re

from kvreplay.backends.rollout import ScorerSpec
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import build
from kvreplay.experiments.rollout.render import (
    mismatch_json,
    mismatch_junit,
    mismatch_screen,
    mismatch_sentence,
)
from kvreplay.experiments.rollout.sides import recorded
from kvreplay.experiments.rollout.table import ROLLOUT
from kvreplay.experiments.rollout.tally import measure
from kvreplay.experiments.rollout.verdict import MismatchBounds, judge, parse_expectation
from kvreplay.harness.gate import GateRequest, GateRun, Judged
from kvreplay.ledger import Record
from kvreplay.measure.rates import Json

TAKEN = ("top_k", "logprobs", "max_tokens", "ignore_eos", "trainer_load")
"""The rollout experiment's options a check takes (one rollout per item: no --samples)."""


class RolloutGate:
    """The trainer gate: the mismatch verdict of a rollout run's rows."""

    options = f"{MismatchBounds.__module__}:{MismatchBounds.__name__}"
    takes = TAKEN

    @staticmethod
    def _bounds(request: GateRequest) -> MismatchBounds:
        bounds: MismatchBounds = build(MismatchBounds, request.own)
        return bounds

    def plan(self, request: GateRequest) -> GateRun:
        """The rollout run the check asks for (its scorer, the options taken), after
        refusing a trainer or an expectation that cannot be judged."""
        trainer = ScorerSpec.parse(request.spec)
        if self._bounds(request).fail_on_growth:
            raise KvreplayError(
                "--fail-on-growth judges rollouts logged over training steps (kvreplay "
                "mismatch); a check samples its rollouts at one step."
            )
        parse_expectation(request.expect, self._bounds(request))
        taken = {k: v for k, v in request.own.items() if k in TAKEN}
        suffix = "-vs-" + re.sub(r"[^A-Za-z0-9._-]+", "-", trainer.label)
        reads = (trainer.model,) if trainer.model is not None else ()
        return GateRun({**taken, "scorers": trainer.label}, suffix, reads)

    def judge(
        self,
        request: GateRequest,
        rows: list[Record],
        config: Json,
        stack: str,
        environment: Json,
    ) -> Judged:
        trainer = ScorerSpec.parse(request.spec).label
        expectation = parse_expectation(request.expect, self._bounds(request))
        done = [r for r in rows if r.experiment == ROLLOUT and r.data["status"] == "ok"]
        measured = measure(recorded(done, config) if done else iter(()), trainer)
        rollout = f"{stack}:{','.join(config['dtypes'])}"
        verdict = judge(measured, trainer, expectation, rollout, environment)
        return Judged(
            verdict,
            mismatch_sentence(verdict),
            mismatch_screen(verdict),
            mismatch_json(verdict),
            mismatch_junit(verdict),
        )


GATE = RolloutGate()
