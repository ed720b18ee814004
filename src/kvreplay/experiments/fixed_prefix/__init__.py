"""The fixed-prefix experiment, one package: its run (``experiment``; it loads torch only
when it runs), declared here and registered by one line in
:mod:`kvreplay.experiments.registry`. Its CSV and its section are the four-arm matrix's,
which matched shares (:mod:`kvreplay.experiments.matrix`)."""

from kvreplay.experiments.matrix.section import MATRIX as SECTION
from kvreplay.experiments.matrix.table import FIXED_PREFIX, FIXED_PREFIX_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import Value, list_of, panel_schema

DECLARATION = Declaration(
    name=FIXED_PREFIX,
    summary="Prefixes fixed across precisions: replay vs prefill in each.",
    experiment=f"{__name__}.experiment:FixedPrefix",
    table=FIXED_PREFIX_TABLE,
    source="Take prefixes from this run (default: this run's bf16 live rows).",
    section=SECTION,
    judged=True,
    outcome_rank=1,
    prefix_kind="prefix",
    schema=panel_schema(
        {
            "dtypes": list_of(str),
            "item_ids": list_of(str),
            "prefix_dtype": Value(str),
            "prefix_from": Value((str, type(None))),
        },
        kinds=("prefix", "matrix"),
    ),
)
