"""The bridge experiment, one package: its run (``experiment``; it loads torch only when it
runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.bridge.experiment import DEFAULT_N
from kvreplay.experiments.bridge.section import BRIDGE as SECTION
from kvreplay.experiments.bridge.table import BRIDGE, BRIDGE_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import Value, list_of, optional, panel_schema

DECLARATION = Declaration(
    name=BRIDGE,
    summary="The retained live state vs the teacher-forced replay of its schedule.",
    experiment=f"{__name__}.experiment:Bridge",
    table=BRIDGE_TABLE,
    source="Take historical prefixes from this run.",
    default_n=str(DEFAULT_N),
    section=SECTION,
    judged=True,
    schema=panel_schema(
        {"dtype": Value(str), "item_ids": list_of(str), "selection": Value(dict)},
        {
            "historical": optional(
                (dict, type(None)),
                fields={
                    "key": Value(str),
                    "row_sha256": Value(str),
                    "prefix_token_count": Value(int, minimum=0),
                    "prefix_sha256": Value(str),
                },
            ),  # fmt: skip
            "selection_index": optional(int, minimum=0),
            "num_layers": optional(int, minimum=1),
            "boundary_cache_sequence_len": optional(int, minimum=0),
        },
        clones=True,  # live_clone, teacher_clone: checked, never continued
    ),
)
