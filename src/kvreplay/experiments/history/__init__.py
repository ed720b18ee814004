"""The history experiment, one package: its run (``experiment``), its CSV (``table``) and
its section of the analysis and report (``section``), declared here and registered by one
line in :mod:`kvreplay.experiments.registry`. It is a server's experiment: its arms are
served panels on the http backend, so its class and its served class are the same."""

from kvreplay.experiments.history.section import HISTORY as SECTION
from kvreplay.experiments.history.table import HISTORY, HISTORY_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import list_of, optional, panel_schema
from kvreplay.harness.served import EVERY_STAGE

DECLARATION = Declaration(
    name=HISTORY,
    summary="On a server: the same hit after different histories of P's blocks (decoded, "
    "warm, evicted) and under --traffic N, beside the miss (history_hit_miss.csv).",
    experiment=f"{__name__}.experiment:History",
    table=HISTORY_TABLE,
    served=f"{__name__}.experiment:History",
    served_table=HISTORY_TABLE,
    section=SECTION,
    needs="traffic",  # its loopback clients: a server's experiment
    check="traffic",
    schema=panel_schema(
        {
            "dtypes": list_of(str),
            "item_ids": list_of(str),
            "miss": optional(str, values=(EVERY_STAGE,)),  # absent in runs before it
        },
    ),
)
