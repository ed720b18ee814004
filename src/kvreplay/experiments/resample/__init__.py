"""The resample experiment, one package: its run (``experiment``; it loads torch only when it
runs), its CSV (``table``) and its section of the analysis and report (``section``),
declared here and registered by one line in :mod:`kvreplay.experiments.registry`."""

from kvreplay.experiments.resample.section import RESAMPLE as SECTION
from kvreplay.experiments.resample.table import RESAMPLE, RESAMPLE_TABLE, SERVED_RESAMPLE_TABLE
from kvreplay.harness.declaration import Declaration

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
    config={
        "dtypes": list,
        "item_ids": list,
        "miss": str,
        "samples": int,
        "seeds": list,
        "replica_samples": int,
        "temperature": (int, float),
        "top_p": (int, float),
        "margin": (int, float),
        "batching": str,
    },
)
