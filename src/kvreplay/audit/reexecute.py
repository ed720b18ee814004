"""Re-execution: the rows an audit re-runs from what they recorded, and the comparison of
each fresh row with the recorded one, field by field, less what legitimately differs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvreplay.contract.config import RunConfig
from kvreplay.core.items import Item
from kvreplay.engines import Placement, make_engine
from kvreplay.harness.rows import row_as_written, without_unrecorded_digests
from kvreplay.harness.units import Unit, UnitKey
from kvreplay.ledger import Record, diff_fields

# Keys that legitimately differ between a run and its re-execution.
UNCHECKED = {"reused_from", "snapshot"}


def _repeatable(data: dict[str, Any]) -> dict[str, Any]:
    """A row without its arms served beside background traffic (``--traffic``): what
    they read and decoded depends on what else the server was doing, which no
    re-execution repeats. They stay in the hash chain, and their CSV columns are
    re-derived from the row like every other."""
    arms = data.get("arms")
    if not isinstance(arms, dict):
        return data
    kept = {
        name: arm
        for name, arm in arms.items()
        if not (isinstance(arm, dict) and isinstance(arm.get("served"), dict)
                and "load" in arm["served"])
    }  # fmt: skip
    return {**data, "arms": kept}


def _strip(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip(v) for k, v in data.items() if k not in UNCHECKED}
    if isinstance(data, list):
        return [_strip(v) for v in data]
    return data


class Reexecution:
    """Rows run again on this machine from what they recorded (their item, precision and
    inputs), each fresh row compared with the recorded one as it was written; a row whose
    key does not say its own item and precision is named, not run."""

    def __init__(
        self,
        config: RunConfig,
        placement: Placement,
        rows: Mapping[str, Record],
        items: dict[str, Item],
    ) -> None:
        self.config, self.placement, self.rows, self.items = config, placement, rows, items
        self.reexecuted = 0

    def units(self, keys: Iterable[str], problems: list[str]) -> list[Unit]:
        """The units that re-execute ``keys``; a row that cannot be one is named."""
        units = []
        for key in keys:
            record = self.rows[key]
            data = record.data
            item = self.items.get(data["item_id"])
            if item is None:
                problems.append(f"row {key}: field item_id names no item")
                continue
            unit_key = UnitKey.of(record)
            if str(unit_key) != key:
                problems.append(f"row {key}: field item_id or precision is not its key's")
                continue
            inputs = {k: v for k, v in data.get("inputs", {}).items() if k != "reuse"}
            units.append(Unit(unit_key, item, data["precision"], inputs))
        return units

    def run(self, keys: Iterable[str]) -> list[str]:
        """Re-execute ``keys`` and name every field that differs."""
        problems: list[str] = []
        units = self.units(keys, problems)
        runner = make_engine(self.config, self.placement)
        try:
            for unit, data, _, _ in runner.run(units):
                recorded = row_as_written(self.rows[str(unit.key)].data)
                fresh = {**data, "inputs": recorded.get("inputs", {})}
                fresh = without_unrecorded_digests(fresh, recorded)
                for path in diff_fields(comparable(recorded), comparable(fresh)):
                    problems.append(f"row {unit.key}: field {path} differs on re-execution")
                self.reexecuted += 1
        finally:
            runner.close()
        return problems


def comparable(data: dict[str, Any]) -> Any:
    """A row as a re-execution must reproduce it."""
    return _strip(_repeatable(data))
