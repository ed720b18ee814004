"""One memory guard (design: option bounds): what a run will hold, estimated from its
options before anything runs.

A row is computed whole, held whole while it is hashed and appended, and every row of a
run stays in its ledger's memory until the run ends; a row longer than a ledger line may
be (:data:`~kvreplay.ledger.records.MAX_ROW_BYTES`) could not even be read back. Options
that multiply into a row (``--samples`` x ``--turns`` x ``--max-tokens`` x scorers) are
each bounded, and their product is bounded here: an experiment says how many values a
row records (:meth:`~kvreplay.harness.experiment.Experiment.row_values`), and a run
whose rows would not fit is refused in one sentence naming what to give less of.
"""

from __future__ import annotations

import os

from kvreplay.core.errors import KvreplayError
from kvreplay.ledger.records import MAX_ROW_BYTES

BYTES_PER_VALUE = 24  # a token id, a log-probability or a margin as JSON, with its comma
MEMORY_SHARE = 0.5  # of this machine's memory, what a run's rows may take


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(values: int, rows: int, options: str) -> None:
    """Refuse rows of ``values`` values each (``rows`` of them) that no ledger line or
    this machine's memory holds; ``options`` names what sets their size."""
    row = values * BYTES_PER_VALUE
    if row > MAX_ROW_BYTES:
        raise KvreplayError(
            f"Each row would hold about {row / 2**20:,.0f} MiB, past the "
            f"{MAX_ROW_BYTES / 2**20:.0f} MiB a ledger line holds; give less {options}."
        )
    memory = machine_memory()
    if memory is not None and row * rows > memory * MEMORY_SHARE:
        raise KvreplayError(
            f"The run's {rows} rows would hold about {row * rows / 2**30:,.1f} GiB, more than "
            f"half this machine's {memory / 2**30:,.1f} GiB; give less {options} or fewer "
            "items (--n)."
        )
