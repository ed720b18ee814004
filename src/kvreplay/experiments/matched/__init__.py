"""The matched experiment, one package: its run (``experiment``; it loads torch only when it
runs) and its screen for ``--select fragile`` (``screen``), declared here and registered by
one line in :mod:`kvreplay.experiments.registry`. Its CSV and its section are the four-arm
matrix's, which fixed-prefix shares (:mod:`kvreplay.experiments.matrix`)."""

from kvreplay.experiments.matrix.section import MATRIX as SECTION
from kvreplay.experiments.matrix.table import MATCHED, MATCHED_TABLE, SERVED_MATCHED_TABLE
from kvreplay.harness.declaration import Declaration

DECLARATION = Declaration(
    name=MATCHED,
    summary="Per item and precision, the retained live state vs a one-shot prefill.",
    experiment=f"{__name__}.experiment:Matched",
    table=MATCHED_TABLE,
    served=f"{__name__}.experiment:ServedMatched",
    served_table=SERVED_MATCHED_TABLE,
    options="kvreplay.experiments.matched.screen:MatchedOptions",
    section=SECTION,
    check="greedy",
    judged=True,
    outcome_rank=2,
    config={"dtypes": list, "item_ids": list, "miss": str, "fragile": dict},
)
