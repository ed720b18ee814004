"""The matched experiment, one package: its run (``experiment``; it loads torch only when it
runs) and its screen for ``--select fragile`` (``screen``), declared here and registered by
one line in :mod:`kvreplay.experiments.registry`. Its CSV and its section are the four-arm
matrix's, which fixed-prefix shares (:mod:`kvreplay.experiments.matrix`)."""

from kvreplay.experiments.matrix.section import MATRIX as SECTION
from kvreplay.experiments.matrix.table import MATCHED, MATCHED_TABLE, SERVED_MATCHED_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import NUMBER, Value, list_of, optional, panel_schema
from kvreplay.harness.served import EVERY_STAGE

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
    schema=panel_schema(
        {
            "dtypes": list_of(str),
            "item_ids": list_of(str),
            "miss": optional(str, values=(EVERY_STAGE,)),  # a served run's
            "fragile": optional(dict, fields={"n": Value(int), "window": Value(int)}),
        },
        # a fragile screen's rows are prefix rows with the margins it ranks by
        {"screen_margins": optional(list, each=Value(NUMBER, minimum=0))},
        kinds=("prefix",),
    ),
)
