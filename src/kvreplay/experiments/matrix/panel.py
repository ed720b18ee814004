"""The four-arm matrix shared by ``matched`` and ``fixed-prefix``: a left arm (the
retained ``live`` state, or the ``replay`` rebuild the paper calls "incremental") against
a one-shot ``prefill``, each with a storage-disjoint replica, all four continued. Its CSV
is declared in :mod:`kvreplay.experiments.matrix.table`.
"""

from __future__ import annotations

from typing import Any

from kvreplay.harness.panel import Arm, Panel
from kvreplay.harness.units import Clock, Unit, Workbench


def matrix_panel(left: str) -> Panel[Arm]:
    """The matrix's arms: ``left`` (``live`` or ``replay``) and ``prefill``, replicated."""
    return Panel((Arm("left", left), Arm("prefill", "prefill")))


def run_matrix(worker: Workbench, unit: Unit, clock: Clock, panel: Panel[Arm]) -> dict[str, Any]:
    """One (item, precision) row, or an unreached one when live generation stopped short."""
    from kvreplay.harness.executor import run_panel  # in process only: loads torch

    result = run_panel(worker, unit, clock, panel)
    row = result.row
    if row is None:
        return {"status": "unreached", **result.prefix}
    row.fields = {
        "left_construction": panel.arms[0].construction,
        "source": unit.inputs.get("source", {}),
        "labels": row.labels.to_dict(),
    }
    return row.to_dict()
