"""``bridge``: the retained live state vs the teacher-forced replay of its schedule, over
every layer, the boundary logits and the suffix (``live_teacher_bridge.csv``).

Items are chosen outcome-blind, spread over prefix length: order statistics of the
lengths known before any bridge row runs (this run's ``matched`` prefixes when present,
else prompt lengths), recorded in the manifest before the first row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreplay.core.items import Item
from kvreplay.experiments.matrix.table import MATCHED
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Arm, Panel
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.selection import prompt_lengths, spread_selection
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

# Items a bridge runs when --n is not given: each row advances every layer twice.
DEFAULT_N = 12


class Bridge(Experiment):
    panel = Panel((Arm("live", "live", replica="clone"), Arm("teacher", "replay", replica="clone")))

    def default_n(self, total: int) -> int:
        return min(DEFAULT_N, total)

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items  # the selection spreads over every item's length

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        """An outcome-blind spread over prefix length: this run's ``matched`` prefixes
        when there are enough (lengths are not outcomes), else prompt lengths."""
        n = self.count(scope.n, scope.items)
        dtype = scope.dtypes[0]
        known = {
            r.data["item_id"]: r.data["prefix_token_count"]
            for r in rows.values()
            if r.experiment == MATCHED and r.data["precision"] == dtype and r.data["status"] == "ok"
        }
        basis = "matched_prefix" if len(known) >= n else "prompt_tokens"
        if basis == "prompt_tokens":
            known = prompt_lengths(scope, scope.items)
        chosen = set(spread_selection([(length, i) for i, length in known.items()], n))
        selected = [i for i in scope.items if i.id in chosen]
        return Selection(selected, {"rule": "outcome_blind_length_spread", "basis": basis, "n": n})

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "dtype": scope.dtypes[0],
            "item_ids": [item.id for item in selection.items],
            "selection": selection.rule,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        dtype = scope.dtypes[0]
        sources = {**scope.source_rows(), **rows}
        units = []
        for index, item in enumerate(selection.items):
            inputs: dict[str, Any] = {"selection_index": index}
            historical = sources.get(str(UnitKey(MATCHED, item.id, dtype)))
            if historical is not None and historical.data.get("status") == "ok":
                inputs["historical"] = {
                    "key": historical.key,
                    "row_sha256": historical.row_sha256,
                    "prefix_token_count": historical.data["prefix_token_count"],
                    "prefix_sha256": historical.data["prefix_sha256"],
                }
                arm = historical.data["arms"]["left"]
                inputs["reuse"] = {"live": {"key": historical.key, "arm": arm}}
            units.append(Unit(UnitKey(self.name, item.id, dtype), item, dtype, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], [config["dtype"]], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        from kvreplay.harness.executor import run_panel  # in process only: loads torch

        result = run_panel(worker, unit, clock, self.panel)
        base = {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "selection_index": unit.inputs["selection_index"],
            "num_layers": result.lm.num_layers,
        }
        if result.row is None:
            return {**base, "status": "unreached", **result.prefix}
        result.row.fields = {
            **base,
            "historical": unit.inputs.get("historical"),
            "boundary_cache_sequence_len": result.boundary_cache_len,
        }
        return result.row.to_dict()
