"""The rollout experiment, one package (design: rollout stack, scorer, mismatch): its run
(``experiment``; it loads torch only when a unit runs), the per-rollout routine
(``roll``), its CSV (``table``), the CSV read back as sequences (``sides``) and its
section of the analysis and report (``section``), declared here and registered by one
line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.rollout.schema import SCHEMA
from kvreplay.experiments.rollout.section import ROLLOUT_SECTION
from kvreplay.experiments.rollout.table import ROLLOUT, ROLLOUT_TABLE
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
    schema=SCHEMA,
)
