"""Re-execution: the rows an audit re-runs from what they recorded, and the comparison of
each fresh row with the recorded one, field by field, less what legitimately differs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvreplay.audit.crossing import Tally, cross
from kvreplay.audit.platform import CAPABILITY, PIN, Platform
from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError
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
    inputs), each fresh row compared with the recorded one as it was written: bit for
    bit on the recorder's platform, at the level that crosses platforms elsewhere
    (:mod:`kvreplay.audit.crossing`). A row whose key does not say its own item and
    precision is named, not run. ``sampled``: the experiments that draw at T > 0."""

    def __init__(
        self,
        config: RunConfig,
        placement: Placement,
        rows: Mapping[str, Record],
        items: dict[str, Item],
        platform: Platform = Platform(),  # noqa: B008 - a frozen value
        sampled: frozenset[str] = frozenset(),
    ) -> None:
        self.config, self.placement, self.rows, self.items = config, placement, rows, items
        self.platform, self.sampled = platform, sampled
        self.reexecuted = 0
        self.tally = Tally()

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
        runner = make_engine(self.config, self.placement, self.platform.pin)
        try:
            self._check_pinned(runner)
            for unit, data, _, _ in runner.run(units):
                record = self.rows[str(unit.key)]
                recorded = row_as_written(record.data)
                fresh = {**data, "inputs": recorded.get("inputs", {})}
                fresh = without_unrecorded_digests(fresh, recorded)
                problems += self.compare(str(unit.key), record, recorded, fresh)
                self.reexecuted += 1
        finally:
            runner.close()
        return problems

    def compare(
        self, key: str, record: Record, recorded: dict[str, Any], fresh: dict[str, Any]
    ) -> list[str]:
        """The problems of one re-executed row (counted in ``tally`` across platforms)."""
        ours, theirs = comparable(recorded), comparable(fresh)
        differing = diff_fields(ours, theirs)
        if self.platform.same:
            return [f"row {key}: field {path} differs on re-execution" for path in differing]
        if not differing:
            self.tally.add(key, None)
            return []
        sampled = record.experiment in self.sampled
        bound = self.config.backend.near_tie(str(recorded.get("precision")))
        found = cross(key, ours, theirs, differing, bound, sampled)
        self.tally.add(key, found)
        return found.problems

    def _check_pinned(self, runner: Any) -> None:
        """A pin that did not take would compare other kernels' bits as the recorder's."""
        wanted = self.platform.pin.get(PIN)
        got = {str(d.get(CAPABILITY, "")).lower() for d in getattr(runner, "devices", [])}
        if wanted and got != {wanted}:
            raise KvreplayError(
                f"The audit's workers did not run on torch's {wanted} kernels as pinned "
                f"(they report {', '.join(sorted(got)) or 'nothing'})."
            )


def comparable(data: dict[str, Any]) -> Any:
    """A row as a re-execution must reproduce it."""
    return _strip(_repeatable(data))
