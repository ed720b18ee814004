"""The battery experiment, one package (design: request shape, battery, comparison
level): the request shapes (``shapes``), a shape read back from its row (``outcome``),
its run (``experiment``), its CSV (``table``) and its section (``section``), declared
here and registered by one line in :mod:`kvreplay.experiments.registry`. It is a serving
engine's experiment: its arms are served requests, so its class and its served class are
the same. A check on a backend with a prefix cache runs it by default (its check role,
``gate``)."""

from kvreplay.experiments.battery.section import SECTION
from kvreplay.experiments.battery.table import BATTERY, BATTERY_TABLE
from kvreplay.harness.declaration import Declaration

DECLARATION = Declaration(
    name=BATTERY,
    summary="On a serving engine with a prefix cache: each item's prompt served as a miss "
    "and as a hit after each request shape's history (warm, block-aligned, second hit, "
    "interloper, companion, batched, sampled, random cut, evicted, preempted), compared at "
    "the level the clean engine is exact (battery_shapes.csv).",
    experiment=f"{__name__}.experiment:Battery",
    table=BATTERY_TABLE,
    served=f"{__name__}.experiment:Battery",
    served_table=BATTERY_TABLE,
    options=f"{__name__}.experiment:BatteryOptions",
    section=SECTION,
    capability="cache_control",
    check="gate",
    judged=True,
    config={
        "dtypes": list,
        "item_ids": list,
        "shapes": list,
        "level": str,
        "stop_at_first": bool,
    },
)
