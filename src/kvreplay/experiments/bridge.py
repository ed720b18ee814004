"""``bridge``: the retained live state vs the teacher-forced replay of its schedule, over
every layer, the boundary logits and the suffix (``live_teacher_bridge.csv``).

Items are chosen outcome-blind, spread over prefix length: order statistics of the
lengths known before any bridge row runs (this run's ``matched`` prefixes when present,
else prompt lengths), recorded in the manifest before the first row.
"""

from __future__ import annotations

from typing import Any

from kvreplay.comparison import Comparison
from kvreplay.experiments.columns import Column, Line
from kvreplay.experiments.experiment import Experiment, planned_keys
from kvreplay.experiments.matched import MATCHED
from kvreplay.experiments.panel import Arm, Panel, run_panel
from kvreplay.experiments.scope import Scope, Selection
from kvreplay.experiments.selection import prompt_lengths, spread_selection
from kvreplay.experiments.units import Clock, Unit, UnitKey, Workbench
from kvreplay.items import Item
from kvreplay.ledger import Record


def _historical(line: Line) -> dict[str, Any]:
    """The prefix this item had in the historical (``matched``) row; its own without one."""
    return line.row.fields["historical"] or line.row.prefix


def _clone(arm: str, what: str) -> Column[Line]:
    return Column(f"{arm}_clone_{what}", lambda x: getattr(x.row.replicas[arm], what))


def _field(name: str) -> Column[Line]:
    return Column(name, lambda x: x.row.fields[name])


def _cmp(x: Line) -> Comparison:
    assert x.row.comparison is not None
    return x.row.comparison


TABLE: list[Column[Line]] = [
    Column("row_id", lambda x: x.row.item_id),
    Column("source_row_sha256", lambda x: x.source_row_sha256),
    _field("selection_index"),
    Column("new_prefix_token_count", lambda x: x.row.prefix["prefix_token_count"]),
    Column("new_prefix_sha256", lambda x: x.row.prefix["prefix_sha256"]),
    Column("historical_prefix_token_count", lambda x: _historical(x)["prefix_token_count"]),
    Column("historical_prefix_sha256", lambda x: _historical(x)["prefix_sha256"]),
    Column(
        "live_matches_historical_prefix",
        lambda x: _historical(x)["prefix_sha256"] == x.row.prefix["prefix_sha256"],
    ),
    _field("boundary_cache_sequence_len"),
    Column("post_decode_cache_sequence_len", lambda x: x.row.arms["live"].post_decode_cache_len),
    _clone("live", "cache_exact"),
    _clone("live", "logits_exact"),
    _clone("teacher", "cache_exact"),
    _clone("teacher", "logits_exact"),
    Column("functional_state_equal", lambda x: x.row.functional_state_equal),
    Column("all_storage_disjoint", lambda x: x.row.all_storage_disjoint),
    Column("live_teacher_cache_exact", lambda x: _cmp(x).cache_exact),
    Column("live_teacher_logits_exact", lambda x: _cmp(x).logits["exact"]),
    Column("boundary_argmax_equal", lambda x: _cmp(x).boundary_argmax_equal),
    Column("live_suffix_sha256", lambda x: x.row.arms["live"].suffix_sha256),
    Column("teacher_suffix_sha256", lambda x: x.row.arms["teacher"].suffix_sha256),
    Column("live_teacher_suffix_exact", lambda x: not x.row.diverges),
    Column(
        "all_48_layers_exact", lambda x: all(layer["kv"]["exact"] for layer in _cmp(x).per_layer)
    ),
    Column("integrity_pass", lambda x: x.row.integrity_pass),
    Column("precision", lambda x: x.row.precision),
    _field("num_layers"),
    Column("historical_source", lambda x: (x.row.fields["historical"] or {"key": "none"})["key"]),
    Column("first_suffix_divergence_index", lambda x: x.row.labels.first_suffix_divergence_index),
]


class Bridge(Experiment):
    name = "bridge"
    csv_file = "live_teacher_bridge.csv"
    table = TABLE
    panel = Panel((Arm("live", "live", replica="clone"), Arm("teacher", "replay", replica="clone")))

    def default_n(self, total: int) -> int:
        return min(12, total)

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

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], [config["dtype"]], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
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

    def lines(self, rows: list[Record]) -> list[Line]:
        return [Line(self.read_row(r.data), r.row_sha256) for r in rows if r.data["status"] == "ok"]
