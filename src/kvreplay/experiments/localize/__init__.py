"""The localize experiment, one package: its run (``experiment``; it loads torch only when
it runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.localize.section import LOCALIZE as SECTION
from kvreplay.experiments.localize.table import LOCALIZE, LOCALIZE_TABLE
from kvreplay.harness.declaration import Declaration

DECLARATION = Declaration(
    name=LOCALIZE,
    summary="Which layers, keys or values carry a divergent trajectory (localize.csv).",
    experiment=f"{__name__}.experiment:Localize",
    table=LOCALIZE_TABLE,
    options="kvreplay.harness.selection:PanelOptions",
    takes=("divergent", "panel_seed", "both_directions"),
    source="Take the divergent rows and their prefixes from this run.",
    section=SECTION,
    config={"precision": str, "directions": list, "sweeps": list, "selection": dict},
)
