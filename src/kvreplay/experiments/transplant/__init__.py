"""The transplant experiment, one package: its run (``experiment``; it loads torch only when it
runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.transplant.section import TRANSPLANT as SECTION
from kvreplay.experiments.transplant.table import TRANSPLANT, TRANSPLANT_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import Value, list_of, optional, panel_schema

DECLARATION = Declaration(
    name=TRANSPLANT,
    summary="The six-arm K/V transplant panel (kv_transplant_<name>.csv).",
    experiment=f"{__name__}.experiment:Transplant",
    table=TRANSPLANT_TABLE,
    options="kvreplay.harness.selection:PanelOptions",
    takes=("panel", "alias", "name", "divergent", "controls", "panel_seed"),
    source="Take the panel and its prefixes from this run.",
    section=SECTION,
    schema=panel_schema(
        {
            "precision": Value(str),
            "prefix_dtype": Value(str),
            "arms": list_of(str),
            "csv_name": Value(str),
            "selection": Value(dict),
        },
        {
            "panel": optional(
                dict,
                fields={
                    "checkpoint_alias": Value(str),
                    "selection_index": Value(int, minimum=0),
                    "selection_basis": Value(str),
                    "historical_stratum": Value(str),
                    "panel": Value(str),
                },
            ),
            "num_layers": optional(int, minimum=1),
        },  # fmt: skip
        kinds=("prefix", "transplant"),
    ),
)
