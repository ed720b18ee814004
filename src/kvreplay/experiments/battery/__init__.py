"""The battery experiment, one package (design: request shape, battery, comparison
level): the request shapes (``shapes``), a shape read back from its row (``outcome``),
its run (``experiment``), its CSV (``table``) and its section (``section``), declared
here and registered by one line in :mod:`kvreplay.experiments.registry`. It is a serving
engine's experiment: its arms are served requests, so its class and its served class are
the same. A check on a backend with a prefix cache runs it by default (its check role,
``gate``)."""

from kvreplay.experiments.battery.outcome import CHOSEN_LEVELS, FIELD, LEVELS
from kvreplay.experiments.battery.section import SECTION
from kvreplay.experiments.battery.table import BATTERY, BATTERY_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import Value, list_of, panel_schema

# A shape as its row records it (experiment.py: Battery.run_unit), in the order it ran.
SHAPE = {
    "shape": Value(str),
    "level": Value(str, values=LEVELS),
    "exercised": Value((bool, type(None))),
    "note": Value((str, type(None))),
}

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
    schema=panel_schema(
        {
            "dtypes": list_of(str),
            "item_ids": list_of(str),
            "shapes": list_of(str),
            "level": Value(str, values=CHOSEN_LEVELS),
            "stop_at_first": Value(bool),
        },
        {
            FIELD: Value(
                dict,
                fields={
                    "compared": list_of(str),
                    "shapes": Value(list, each=Value(dict, fields=SHAPE)),
                },
            ),
        },
    ),
)
