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
            "num_layers": optional(int, minimum=1),
            "divergent": optional(bool),
            "probes": optional(
                list,
                each=Value(
                    dict,
                    fields={
                        "direction": Value(str),
                        "sweep": Value(str),
                        "layers": Value(list, each=Value(int, minimum=0)),
                        "component": Value(str),
                        "recovers_donor": Value(bool),
                        "first_divergence_index": Value((int, type(None))),
                    },
                ),
            ),  # fmt: skip
            "boundary_argmax_equal": optional(bool),
        },
    ),
)
