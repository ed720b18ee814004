"""The fixed-prefix experiment, one package: its run (``experiment``; it loads torch only
when it runs), declared here and registered by one line in
:mod:`kvreplay.experiments.registry`. Its CSV and its section are the four-arm matrix's,
which matched shares (:mod:`kvreplay.experiments.matrix`)."""

from kvreplay.experiments.matrix.section import MATRIX as SECTION
from kvreplay.experiments.matrix.table import FIXED_PREFIX, FIXED_PREFIX_TABLE
from kvreplay.harness.declaration import Declaration

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
    config={
        "dtypes": list,
        "item_ids": list,
        "prefix_dtype": str,
        "prefix_from": (str, type(None)),
    },
)
