"""``matched``: per item and precision, the retained live state vs a one-shot prefill of
the same prefix, each with a replica (``matched_live_prefill.csv``; its table, with the
served one, is :mod:`kvreplay.experiments.matrix.table`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvreplay.core.items import Item
from kvreplay.experiments.matched.screen import WINDOW, MatchedOptions, ranked, screen_row
from kvreplay.experiments.matrix.panel import matrix_panel, run_matrix
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Panel
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.served import EVERY_STAGE, MISS, ServedArm, miss_input, run_served_panel
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record


class Matched(Experiment):
    """Per item and precision, live vs prefill. With ``--select fragile`` a first phase
    screens candidates (:mod:`kvreplay.experiments.matched.screen`) and the rows run for the most
    fragile, riskiest first."""

    panel = matrix_panel("live")
    phases = 2  # the screens of --select fragile (none otherwise), then the rows

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        n = self.count(scope.n, scope.items)
        options = MatchedOptions.of(scope)
        if options.select == "first":
            return Selection(scope.items[:n], {"rule": "first_n", "n": n})
        screen = options.candidates(n, len(scope.items))
        return Selection(scope.items[:screen], {"rule": "fragile", "n": n, "screen": screen})

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        config = {"dtypes": list(scope.dtypes), "item_ids": [item.id for item in selection.items]}
        if selection.rule["rule"] == "fragile":  # a first-n run's config stays as it was
            config["fragile"] = {"n": selection.rule["n"], "window": WINDOW}
        return config

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        fragile = selection.rule["rule"] == "fragile"
        if phase == 0:
            screen = scope.dtypes[0]
            return [
                Unit(UnitKey.prefix(self.name, item.id), item, screen)
                for item in (selection.items if fragile else [])
            ]
        items = selection.items
        if fragile:
            by_id = {item.id: item for item in items}
            chosen = ranked(self.name, list(by_id), rows, selection.rule["n"])
            items = [by_id[item_id] for item_id in chosen]
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype)
            for dtype in scope.dtypes
            for item in items
        ]

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        if "fragile" not in config:
            return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)
        screens = [str(UnitKey.prefix(self.name, item)) for item in config["item_ids"]]
        chosen = ranked(self.name, config["item_ids"], rows, config["fragile"]["n"])
        return screens + planned_keys(self.name, chosen, config["dtypes"], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        if unit.key.is_prefix:
            return screen_row(worker, unit, clock, served=False)
        row = run_matrix(worker, unit, clock, self.panel)
        return {"item_id": unit.item.id, "precision": unit.precision, **row}


class ServedMatched(Matched):
    """``matched`` on a serving backend: a prefix-cache hit vs a miss of the same P, each
    with a replica under the same cache condition, beside the uninterrupted request and
    the hit co-scheduled with companions (see :mod:`kvreplay.harness.served`). Its
    rows fill the matched ledger's columns where they apply and leave the K/V ones empty."""

    served = True

    panel = Panel(
        (
            ServedArm("left", "hit"),
            ServedArm("prefill", "miss"),
            ServedArm("uninterrupted", "uninterrupted", replica="none"),
            ServedArm("batched", "hit", replica="none", companions=True),
        )
    )

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {**super().config(scope, selection), MISS: EVERY_STAGE}

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        """Each unit names its companions (:meth:`derived_inputs`)."""
        items = {item.id: item for item in selection.items}
        derived = self.derived_inputs(self.config(scope, selection), scope.config, items)
        return [
            replace(unit, inputs=derived[str(unit.key)])
            for unit in super().units(phase, scope, selection, rows)
        ]

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """The next items of the selection, in turn, as each unit's companions, and how
        its miss arm serves later stages."""
        selected = [items[i] for i in config["item_ids"]]
        k = min(run.backend.companions, len(selected) - 1)
        return {
            str(UnitKey(self.name, item.id, dtype)): {
                "companions": companions(selected, i, k),
                **miss_input(config),
            }
            for dtype in config["dtypes"]
            for i, item in enumerate(selected)
        } | {str(UnitKey.prefix(self.name, item.id)): {} for item in selected}

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        if unit.key.is_prefix:
            return screen_row(worker, unit, clock, served=True)
        row, prefix = run_served_panel(worker, unit, clock, self.panel)
        if row is None:
            return {"item_id": unit.item.id, "precision": unit.precision, "status": "unreached",
                    **prefix}  # fmt: skip
        row.fields |= {
            "left_construction": self.panel.arms[0].construction,
            "labels": row.labels.to_dict(),
        }
        return row.to_dict()


def companions(items: list[Item], index: int, k: int) -> list[dict[str, Any]]:
    """The ``k`` items after ``index``, wrapping around, as plain data for the unit."""
    mates = [items[(index + step) % len(items)] for step in range(1, k + 1)]
    return [{"item_id": item.id, "prompt": item.prompt} for item in mates]
