"""``matched``: per item and precision, the retained live state vs a one-shot prefill of
the same prefix, each with a replica (``matched_live_prefill.csv``)."""

from __future__ import annotations

from typing import Any

from kvreplay.experiments.columns import Line
from kvreplay.experiments.experiment import Experiment, planned_keys
from kvreplay.experiments.matrix import matrix_columns, matrix_panel, run_matrix
from kvreplay.experiments.scope import Scope, Selection
from kvreplay.experiments.units import Clock, Unit, UnitKey, Workbench
from kvreplay.items import Item
from kvreplay.ledger import Record

MATCHED = "matched"


class Matched(Experiment):
    name = MATCHED
    csv_file = "matched_live_prefill.csv"
    panel = matrix_panel("live")
    table = matrix_columns("live", paper_l2=False)

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {"dtypes": list(scope.dtypes), "item_ids": [item.id for item in selection.items]}

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype)
            for dtype in scope.dtypes
            for item in selection.items
        ]

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        row = run_matrix(worker, unit, clock, self.panel)
        return {"item_id": unit.item.id, "precision": unit.precision, **row}

    def lines(self, rows: list[Record]) -> list[Line]:
        """Rows of items that reached the boundary at every precision.

        Live generation may reach the boundary at one precision and not another; the
        paper's ledger pairs precisions row by row, so such items stay in rows.jsonl and
        in the run summary (as unreached) but not in the CSV.
        """
        precisions = {r.data["precision"] for r in rows}
        reached: dict[str, set[str]] = {}
        for r in rows:
            if r.data["status"] == "ok":
                reached.setdefault(r.data["item_id"], set()).add(r.data["precision"])
        complete = {item for item, seen in reached.items() if seen == precisions}
        return [
            Line(self.read_row(r.data), r.row_sha256) for r in rows if r.data["item_id"] in complete
        ]
