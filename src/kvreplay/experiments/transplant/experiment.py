"""``transplant``: the six-arm panel behind the paper's causal claim
(``kv_transplant_<name>.csv``).

Per row, over one fixed prefix at one precision: ``replay`` (the paper's "incremental")
and ``prefill``, each with a storage-disjoint replica, plus two transplants: the prefill
state carrying every K/V layer of the replay state, and the replay state carrying every
K/V layer of the prefill state. All six are continued to the end. A transplant recovers
its donor when its suffix equals the donor's own suffix token for token.

Only K and V move; the recipient keeps its own boundary logits, which choose the first
suffix token. When the two boundary argmaxes are equal (``boundary_argmax_equal``) a
transplanted state feeds the donor's first token into the donor's cache, so greedy
decoding is then exactly the donor's computation and recovery is guaranteed; when they
differ, recovery is an empirical question and the flag says so on the row.

Panels are chosen before any row runs and recorded in the manifest:
``stratified`` takes a prior run's divergent rows and exact controls, each stratum
spread over prefix length (the paper's 24 + 8 at C0); ``blind`` spreads over prefix
length and identifier without looking at any outcome (the paper's C1 replication).
Phase 0 records one prefix row per panel row (copied from the source run or generated
live), phase 1 runs the six arms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.experiments.registry import outcome_sources
from kvreplay.experiments.transplant.table import SWAPS
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Arm, Panel, Transplanted
from kvreplay.harness.prefixes import prefix_inputs, prefix_row, prefix_unit
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.selection import PanelOptions, select_panel
from kvreplay.harness.table import RUN_NAME
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

DEFAULT_NAME = {"stratified": "primary", "blind": "later"}
PANEL = Panel(
    arms=(Arm("left", "replay"), Arm("prefill", "prefill")),
    transplants=tuple(Transplanted(s.name, donor=s.donor, recipient=s.recipient) for s in SWAPS),
)


def _names(scope: Scope) -> Callable[[str], dict[str, str]]:
    """The checkpoint alias and the ledger name (``kv_transplant_<name>.csv``) of a panel."""

    def names(panel: str) -> dict[str, str]:
        options = PanelOptions.of(scope)
        name = options.name or DEFAULT_NAME[panel]
        if not RUN_NAME.fullmatch(name):
            raise KvreplayError(f"--name {name!r} may hold only letters, digits, '_' and '-'.")
        alias = options.alias or Path(scope.config.model).name
        return {"alias": alias, "name": name}

    return names


class Transplant(Experiment):
    panel = PANEL
    phases = 2

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        panel = PanelOptions.of(scope).panel
        return select_panel(self.name, panel, scope, rows, outcome_sources(), _names(scope))

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "precision": scope.dtypes[0],
            "prefix_dtype": scope.config.backend.prefix_precision,
            "arms": self.panel.arm_names,
            "csv_name": self.table.file.format(name=selection.rule["name"]),
            "selection": selection.rule,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        by_id = {item.id: item for item in selection.items}
        sources = scope.source_rows()
        precision = scope.dtypes[0]
        units = []
        for entry in selection.rule["rows"]:
            item = by_id[entry["item_id"]]
            key = UnitKey.prefix(self.name, item.id)
            if phase == 0:
                source = sources.get(entry["source_key"])
                units.append(prefix_unit(key, item, scope.config.backend.prefix_precision, source))
                continue
            prefix = rows[str(key)]
            if prefix.data["status"] != "ok":
                continue
            inputs = {
                **prefix_inputs(prefix),
                "source": prefix.data["source"],
                "panel": {
                    "checkpoint_alias": selection.rule["alias"],
                    "selection_index": entry["selection_index"],
                    "selection_basis": selection.rule["basis"],
                    "historical_stratum": entry["historical_stratum"],
                    "panel": selection.rule["panel"],
                },
            }
            units.append(Unit(UnitKey(self.name, item.id, precision), item, precision, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        ids = [entry["item_id"] for entry in config["selection"]["rows"]]
        return planned_keys(self.name, ids, [config["precision"]], rows, prefixed=True)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        from kvreplay.harness.executor import run_panel  # in process only: loads torch

        if unit.key.is_prefix:
            return prefix_row(worker, unit, clock)
        result = run_panel(worker, unit, clock, self.panel)
        assert result.row is not None, "a recorded prefix always reaches its boundary"
        result.row.fields = {
            "kind": "transplant",
            "left_construction": "replay",
            "num_layers": result.lm.num_layers,
            "source": unit.inputs.get("source", {}),
            "panel": unit.inputs["panel"],
            "labels": result.row.labels.to_dict(),
        }
        return result.row.to_dict()
