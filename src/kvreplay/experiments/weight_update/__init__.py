"""The weight-update experiment, one package (design: weight update arm): what a rollout
engine serves once an RL step has synced new weights into it: a prompt cached before the
update sent again after it (a correct sync serves a miss; a forgotten reset, the stale
cache) and a rollout continued across the update in flight (``experiment``), its CSV
(``table``), its section (``section``) and the gate of ``kvreplay check --update``
(``gate``), its declared schema (``schema``); declared here and registered by one line in
:mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.weight_update.schema import SCHEMA
from kvreplay.experiments.weight_update.section import UPDATE_SECTION
from kvreplay.experiments.weight_update.table import UPDATE_TABLE, WEIGHT_UPDATE
from kvreplay.harness.declaration import Declaration

DECLARATION = Declaration(
    name=WEIGHT_UPDATE,
    summary="A rollout engine updated to new weights mid-run through its own path: the stale "
    "prefix cache a sync can leave, and the in-flight term of a rollout continued across the "
    "update (weight_update.csv).",
    experiment=f"{__name__}.experiment:WeightUpdateExperiment",
    table=UPDATE_TABLE,
    served=f"{__name__}.experiment:WeightUpdateExperiment",
    served_table=UPDATE_TABLE,
    options=f"{__name__}.experiment:UpdateOptions",
    temperature=1.0,
    default_n="4",
    section=UPDATE_SECTION,
    capability="weight_update",
    check="update",
    gate=f"{__name__}.gate:GATE",
    schema=SCHEMA,
)
