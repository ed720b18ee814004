"""``history``: do continuations depend on which history wrote the cached blocks they
read, or on what else the server was doing? (``history_hit_miss.csv``)

Per item and precision, on a server (the http backend), the same hit request for P's
first suffix stage is served after different histories (see
:mod:`kvreplay.harness.served`), each from a reset cache:

- ``hit``: P's blocks written by the generation that decoded through P (with a replica);
- ``miss``: none (a one-shot prefill of P; with a replica);
- ``traffic``: the hit while ``--traffic N`` loopback clients send other items' prompts
  and random-token prompts (:mod:`kvreplay.backends.traffic`), the load recorded;
- ``warm``: P's blocks written by an earlier one-shot prefill of P;
- ``evicted``: the hit after unrelated prompts overwrote part of P's blocks; the row says
  how many cached tokens the hit actually read (all, part or none of them).

Its CSV is declared in :mod:`kvreplay.experiments.history.table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreplay.core.items import Item
from kvreplay.harness.experiment import Experiment, derived_units, planned_keys
from kvreplay.harness.panel import Panel
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.served import EVERY_STAGE, MISS, ServedArm, miss_input, run_served_panel
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

TRAFFIC_PROMPTS = 8
"""Other items whose prompts the traffic clients send (beside random-token prompts)."""


class History(Experiment):
    """The hit after different histories; a server's experiment (the http backend)."""

    served = True
    panel = Panel(
        (
            ServedArm("hit", "hit"),
            ServedArm("miss", "miss"),
            ServedArm("traffic", "hit", replica="none", traffic=True),
            ServedArm("warm", "hit", replica="none", history="warm"),
            ServedArm("evicted", "hit", replica="none", history="evicted"),
        )
    )

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "dtypes": list(scope.dtypes),
            "item_ids": [item.id for item in selection.items],
            MISS: EVERY_STAGE,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        return derived_units(self, scope, selection)

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """The next items of the selection, in turn, as the prompts traffic sends, and how
        the miss arm serves later stages."""
        selected = [items[i] for i in config["item_ids"]]
        k = min(TRAFFIC_PROMPTS, len(selected) - 1)
        return {
            str(UnitKey(self.name, item.id, dtype)): {
                "traffic": [
                    {"item_id": other.id, "prompt": other.prompt}
                    for other in (selected[(i + step) % len(selected)] for step in range(1, k + 1))
                ],
                **miss_input(config),
            }
            for dtype in config["dtypes"]
            for i, item in enumerate(selected)
        }

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        row, prefix = run_served_panel(worker, unit, clock, self.panel)
        if row is None:
            return {"item_id": unit.item.id, "precision": unit.precision, "status": "unreached",
                    **prefix}  # fmt: skip
        return row.to_dict()
