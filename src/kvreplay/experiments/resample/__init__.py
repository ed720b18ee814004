"""The resample experiment, one package: its run (``experiment``; it loads torch only when it
runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.resample.section import RESAMPLE as SECTION
from kvreplay.experiments.resample.table import RESAMPLE, RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.schema import NUMBER, Value, list_of, optional, panel_schema
from kvreplay.harness.served import EVERY_STAGE

DECLARATION = Declaration(
    name=RESAMPLE,
    summary="K seeded samples from the live and prefill states of each prefix: is resampling "
    "from a rebuilt prefix faithful? (resample_live_prefill.csv)",
    experiment=f"{__name__}.experiment:Resample",
    table=RESAMPLE_TABLE,
    served=f"{__name__}.experiment:ServedResample",
    served_table=SERVED_RESAMPLE_TABLE,
    options=f"{__name__}.experiment:ResampleOptions",
    temperature=0.7,
    section=SECTION,
    check="faithful",
    judged=True,
    schema=panel_schema(
        {
            "dtypes": list_of(str),
            "item_ids": list_of(str),
            "miss": optional(str, values=(EVERY_STAGE,)),  # a served run's
            "samples": Value(int),
            "seeds": list_of(int),
            "replica_samples": Value(int),
            "temperature": Value(NUMBER),
            "top_p": Value(NUMBER),
            "margin": Value(NUMBER),
            "batching": Value(str, values=("singleton",)),
        },
        {
            "resample": optional(
                dict,
                fields={
                    "seeds": list_of(int),
                    "replica_samples": Value(int, minimum=1),
                    "margin": Value(NUMBER),
                    "temperature": Value(NUMBER),
                    "top_p": Value(NUMBER),
                },
            ),
        },  # fmt: skip
    ),
)
