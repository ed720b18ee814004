"""The localize experiment, one package: its run (``experiment``; it loads torch only when
it runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.localize.section import LOCALIZE as SECTION
from kvreplay.experiments.localize.table import LOCALIZE, LOCALIZE_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import Value, list_of, optional, panel_schema

DECLARATION = Declaration(
    name=LOCALIZE,
    summary="Which layers, keys or values carry a divergent trajectory (localize.csv).",
    experiment=f"{__name__}.experiment:Localize",
    table=LOCALIZE_TABLE,
    options="kvreplay.harness.selection:PanelOptions",
    takes=("divergent", "panel_seed", "both_directions"),
    source="Take the divergent rows and their prefixes from this run.",
    section=SECTION,
    schema=panel_schema(
        {
            "precision": Value(str),
            "directions": list_of(str),
            "sweeps": list_of(str),
            "selection": Value(dict),
        },
        {
            "left_construction": optional(str),
            "num_layers": optional(int),
            "source": optional(dict),
            "divergent": optional(bool),
            "probes": optional(list, each=Value(dict)),
            "boundary_argmax_equal": optional(bool),
        },
    ),
)
