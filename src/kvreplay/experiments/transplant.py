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

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.errors import KvreplayError
from kvreplay.experiments.columns import Column, Line
from kvreplay.experiments.experiment import Experiment, planned_keys
from kvreplay.experiments.panel import Arm, Panel, Transplanted, run_panel
from kvreplay.experiments.prefixes import prefix_inputs, prefix_row, prefix_unit
from kvreplay.experiments.rows import PairLabels
from kvreplay.experiments.scope import Scope, Selection
from kvreplay.experiments.selection import PREFIX_DTYPE, PanelOptions, select_panel
from kvreplay.experiments.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

DEFAULT_NAME = {"stratified": "primary", "blind": "later"}
PANEL = Panel(
    arms=(Arm("left", "replay"), Arm("prefill", "prefill")),
    transplants=(
        Transplanted("replay_cache_into_prefill", donor="left", recipient="prefill"),
        Transplanted("prefill_cache_into_replay", donor="prefill", recipient="left"),
    ),
)
# The paper's name of each transplanted arm.
PAPER_NAMES = {
    "replay_cache_into_prefill": "incremental_cache_into_prefill",
    "prefill_cache_into_replay": "prefill_cache_into_incremental",
}


def _names(scope: Scope) -> Callable[[str], dict[str, str]]:
    """The checkpoint alias and the ledger name (``kv_transplant_<name>.csv``) of a panel."""

    def names(panel: str) -> dict[str, str]:
        options = PanelOptions.of(scope)
        name = options.name or DEFAULT_NAME[panel]
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise KvreplayError(f"--name {name!r} may hold only letters, digits, '_' and '-'.")
        alias = options.alias or Path(scope.config.model).name
        return {"alias": alias, "name": name}

    return names


def recovers_donor(line: Line, transplanted: Transplanted) -> bool:
    """The transplant's suffix is its donor's own, token for token."""
    arms = line.row.arms
    return arms[transplanted.name].suffix_sha256 == arms[transplanted.donor].suffix_sha256


def donor_divergence_index(line: Line, transplanted: Transplanted) -> int | None:
    arms = line.row.arms
    pair = PairLabels.of(arms[transplanted.name], arms[transplanted.donor])
    return pair.first_suffix_divergence_index


def bidirectional(line: Line) -> bool:
    return all(recovers_donor(line, t) for t in PANEL.transplants)


def stratum_reproduced(line: Line) -> bool:
    historical = line.row.fields["panel"]["historical_stratum"]
    return historical == "not_used" or (historical == "divergent") == line.row.diverges


def _transplant_columns(what: str, get: Callable[[Line, Transplanted], Any]) -> list[Column[Line]]:
    return [
        Column(f"{PAPER_NAMES[t.name]}_{what}", lambda x, t=t: get(x, t)) for t in PANEL.transplants
    ]


def _panel(field: str) -> Column[Line]:
    return Column(field, lambda x: x.row.fields["panel"][field])


# Every flag follows the paper's published transplant gates.
PAPER_TABLE: list[Column[Line]] = [
    Column("row_id", lambda x: x.row.item_id),
    Column("source_row_sha256", lambda x: x.source_row_sha256),
    _panel("checkpoint_alias"),
    _panel("selection_index"),
    _panel("selection_basis"),
    _panel("historical_stratum"),
    Column("historical_stratum_reproduced", stratum_reproduced),
    Column("prefix_token_count", lambda x: x.row.prefix["prefix_token_count"]),
    Column("prefix_sha256", lambda x: x.row.prefix["prefix_sha256"]),
    Column("incremental_replica_exact", lambda x: x.row.replicas["left"].passed),
    Column("prefill_replica_exact", lambda x: x.row.replicas["prefill"].passed),
    Column("functional_state_equal", lambda x: x.row.functional_state_equal),
    Column("boundary_argmax_equal", lambda x: x.row.comparison.boundary_argmax_equal),
    Column("all_storage_disjoint", lambda x: x.row.all_storage_disjoint),
    Column("all_48_layer_pairs_transplanted", lambda x: x.row.all_layers_transplanted),
    Column("incremental_native_suffix_sha256", lambda x: x.row.arms["left"].suffix_sha256),
    Column("prefill_native_suffix_sha256", lambda x: x.row.arms["prefill"].suffix_sha256),
    *_transplant_columns("suffix_sha256", lambda x, t: x.row.arms[t.name].suffix_sha256),
    Column("baseline_divergent", lambda x: x.row.diverges),
    *_transplant_columns("recovers_donor", recovers_donor),
    Column("bidirectional_donor_recovery", bidirectional),
    Column("exact_control_novel_trajectory", lambda x: not x.row.diverges and not bidirectional(x)),
    Column("integrity_pass", lambda x: x.row.integrity_pass),
]
EXTRA_TABLE: list[Column[Line]] = [
    Column("precision", lambda x: x.row.precision),
    Column("num_layers", lambda x: x.row.fields["num_layers"]),
    _panel("panel"),
    Column("prompt_token_count", lambda x: x.row.prefix["prompt_token_count"]),
    Column("first_suffix_divergence_index", lambda x: x.row.labels.first_suffix_divergence_index),
    *_transplant_columns("donor_divergence_index", donor_divergence_index),
    Column("incremental_prefill_cache_exact", lambda x: x.row.comparison.cache_exact),
    Column("incremental_prefill_logits_exact", lambda x: x.row.comparison.logits["exact"]),
    Column("cache_relative_l2_diff", lambda x: x.row.comparison.cache["relative_l2_diff"]),
    Column("incremental_correct", lambda x: x.row.arms["left"].correct),
    Column("prefill_correct", lambda x: x.row.arms["prefill"].correct),
    *_transplant_columns("correct", lambda x, t: x.row.arms[t.name].correct),
]


class Transplant(Experiment):
    name = "transplant"
    csv_file = "kv_transplant_primary.csv"  # the default; a run's own is in its config
    panel = PANEL
    phases = 2

    table = PAPER_TABLE + EXTRA_TABLE

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        panel = PanelOptions.of(scope).panel
        return select_panel(self.name, panel, scope, rows, _names(scope))

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "precision": scope.dtypes[0],
            "prefix_dtype": PREFIX_DTYPE,
            "arms": self.panel.arm_names,
            "csv_name": f"kv_transplant_{selection.rule['name']}.csv",
            "selection": selection.rule,
        }

    def csv_name(self, config: dict[str, Any]) -> str:
        return config["csv_name"]

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
                units.append(prefix_unit(key, item, PREFIX_DTYPE, source))
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

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        ids = [entry["item_id"] for entry in config["selection"]["rows"]]
        return planned_keys(self.name, ids, [config["precision"]], rows, prefixed=True)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
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

    def lines(self, rows: list[Record]) -> list[Line]:
        by_key = {r.key: r for r in rows}
        out = []
        for record in rows:
            data = record.data
            if data.get("kind") != "transplant":
                continue
            prefix = by_key[str(UnitKey.prefix(self.name, data["item_id"]))]
            source = data["source"].get("row_sha256") or prefix.row_sha256
            out.append(Line(self.read_row(data), source))
        return out
