"""The rollout experiment, one package (design: rollout stack, scorer, mismatch): its run
(``experiment``; it loads torch only when a unit runs), the per-rollout routine
(``roll``), its CSV (``table``), the CSV read back as sequences (``sides``), the metrics
(``metrics``), its section of the analysis and report (``section``), the mismatch
verdict and its renderings (``verdict``, ``render``), the gate of ``kvreplay check
--trainer`` (``gate``), rollouts a framework logged (``logged``) and the audit of a
stack of your own (``own_stack``); declared here and registered by one line in
:mod:`kvreplay.experiments.registry`. Nothing outside the package imports its modules:
the rest of kvreplay reaches it through this declaration."""

from kvreplay.experiments.rollout.claims import GroupClaims, plain
from kvreplay.experiments.rollout.logged import TRAINER as LOGGED_TRAINER
from kvreplay.experiments.rollout.logged import Rescorer, read_logged
from kvreplay.experiments.rollout.metrics import ChainTally
from kvreplay.experiments.rollout.own_stack import OwnStackResult, audit_own_stack
from kvreplay.experiments.rollout.render import (
    mismatch_json,
    mismatch_junit,
    mismatch_screen,
    mismatch_sentence,
)
from kvreplay.experiments.rollout.schema import SCHEMA
from kvreplay.experiments.rollout.section import ROLLOUT_SECTION, count, number, summary_lines
from kvreplay.experiments.rollout.sides import Rollout, Side
from kvreplay.experiments.rollout.table import ROLLOUT, ROLLOUT_TABLE
from kvreplay.experiments.rollout.tally import Measured, decomposition_claims, measure, stream_of
from kvreplay.experiments.rollout.verdict import (
    MismatchBounds,
    MismatchExpectation,
    MismatchVerdict,
    judge,
    parse_expectation,
)
from kvreplay.harness.declaration import Declaration

DECLARATION = Declaration(
    name=ROLLOUT,
    summary="The training-inference mismatch: a rollout stack samples, scorers teacher-force "
    "the same tokens; per-token metrics and an exact decomposition (rollout_logprobs.csv).",
    experiment=f"{__name__}.experiment:Rollout",
    table=ROLLOUT_TABLE,
    served=f"{__name__}.experiment:ServedRollout",
    served_table=ROLLOUT_TABLE,  # one CSV whichever backend samples
    options=f"{__name__}.experiment:RolloutOptions",
    temperature=1.0,
    section=ROLLOUT_SECTION,
    capability="rollout",
    check="trainer",
    gate=f"{__name__}.gate:GATE",
    schema=SCHEMA,
)

__all__ = [
    "ChainTally",
    "DECLARATION",
    "GroupClaims",
    "LOGGED_TRAINER",
    "MismatchBounds",
    "MismatchExpectation",
    "MismatchVerdict",
    "Measured",
    "OwnStackResult",
    "ROLLOUT_TABLE",
    "Rescorer",
    "Rollout",
    "Side",
    "audit_own_stack",
    "count",
    "decomposition_claims",
    "judge",
    "measure",
    "mismatch_json",
    "mismatch_junit",
    "mismatch_screen",
    "mismatch_sentence",
    "number",
    "parse_expectation",
    "plain",
    "read_logged",
    "stream_of",
    "summary_lines",
]
