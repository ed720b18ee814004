"""``fixed-prefix``: prefixes taken once (from this run's ``matched`` live rows at the
backend's prefix precision, bf16 unless it says otherwise, a ``--prefix-from`` run, or a
fresh live generation at that precision), then held identical at every
precision: ``replay`` ("incremental") vs ``prefill`` (``fixed_prefix_2x2.csv``).

Phase 0 records one prefix row per item; phase 1 runs the matrix per item and precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreplay.core.items import Item
from kvreplay.experiments.matrix.panel import matrix_panel, run_matrix
from kvreplay.experiments.matrix.table import MATCHED
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.prefixes import prefix_inputs, prefix_row, prefix_unit
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record


def _source_for(item: Item, dtype: str, rows: dict[str, Record]) -> Record | None:
    """A completed live row of ``matched`` for this item at ``dtype``, if any."""
    record = rows.get(str(UnitKey(MATCHED, item.id, dtype)))
    return record if record is not None and record.data.get("status") == "ok" else None


class FixedPrefix(Experiment):
    panel = matrix_panel("replay")
    phases = 2

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "dtypes": list(scope.dtypes),
            "item_ids": [item.id for item in selection.items],
            "prefix_dtype": scope.config.backend.prefix_precision,
            "prefix_from": scope.source.contract_hash if scope.source else None,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        if phase == 0:
            sources = {**scope.source_rows(), **rows}
            precision = scope.config.backend.prefix_precision
            return [
                prefix_unit(
                    UnitKey.prefix(self.name, item.id),
                    item,
                    precision,
                    _source_for(item, precision, sources),
                )
                for item in selection.items
            ]
        units = []
        for dtype in scope.dtypes:
            for item in selection.items:
                prefix = rows[str(UnitKey.prefix(self.name, item.id))]
                if prefix.data["status"] != "ok":
                    continue
                inputs = prefix_inputs(prefix)
                inputs["source"] = prefix.data["source"]
                matched = rows.get(str(UnitKey(MATCHED, item.id, dtype)))
                if matched is not None and matched.data.get("status") == "ok":
                    inputs["reuse"] = {
                        "prefill": {"key": matched.key, "arm": matched.data["arms"]["prefill"]}
                    }
                units.append(Unit(UnitKey(self.name, item.id, dtype), item, dtype, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows, prefixed=True)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        if unit.key.is_prefix:
            return prefix_row(worker, unit, clock)
        base = {"item_id": unit.item.id, "precision": unit.precision}
        return {**base, "kind": "matrix", **run_matrix(worker, unit, clock, self.panel)}
