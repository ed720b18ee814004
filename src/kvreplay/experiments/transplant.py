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

from kvreplay.construct import build
from kvreplay.errors import KvreplayError
from kvreplay.experiments.base import (
    Clock,
    Experiment,
    Scope,
    Selection,
    Unit,
    UnitKey,
    Workbench,
    csv_value,
    functional_state_equal,
    pair_record,
    planned_keys,
    prefix_from_inputs,
    prefix_record,
    replicate_and_run,
)
from kvreplay.experiments.fixed_prefix import prefix_inputs, prefix_row, prefix_unit
from kvreplay.experiments.panel import PREFIX_DTYPE, select_panel
from kvreplay.ledger import Record
from kvreplay.state import BoundaryState, compare, first_divergence, transplant

DEFAULT_NAME = {"stratified": "primary", "blind": "later"}
# The two transplanted arms: (arm, donor arm, recipient arm, paper name).
TRANSPLANTS = (
    ("replay_cache_into_prefill", "left", "prefill", "incremental_cache_into_prefill"),
    ("prefill_cache_into_replay", "prefill", "left", "prefill_cache_into_incremental"),
)
ARMS = (
    "left",
    "left_replica",
    "prefill",
    "prefill_replica",
    *(arm for arm, *_ in TRANSPLANTS),
)
PAPER_COLUMNS = [
    "row_id", "source_row_sha256", "checkpoint_alias", "selection_index", "selection_basis",
    "historical_stratum", "historical_stratum_reproduced", "prefix_token_count",
    "prefix_sha256", "incremental_replica_exact", "prefill_replica_exact",
    "functional_state_equal", "boundary_argmax_equal", "all_storage_disjoint",
    "all_48_layer_pairs_transplanted",
    "incremental_native_suffix_sha256", "prefill_native_suffix_sha256",
    "incremental_cache_into_prefill_suffix_sha256",
    "prefill_cache_into_incremental_suffix_sha256",
    "baseline_divergent", "incremental_cache_into_prefill_recovers_donor",
    "prefill_cache_into_incremental_recovers_donor", "bidirectional_donor_recovery",
    "exact_control_novel_trajectory", "integrity_pass",
]  # fmt: skip
EXTRA_COLUMNS = [
    "precision", "num_layers", "panel", "prompt_token_count", "first_suffix_divergence_index",
    "incremental_cache_into_prefill_donor_divergence_index",
    "prefill_cache_into_incremental_donor_divergence_index",
    "incremental_prefill_cache_exact", "incremental_prefill_logits_exact",
    "cache_relative_l2_diff", "incremental_correct", "prefill_correct",
    "incremental_cache_into_prefill_correct", "prefill_cache_into_incremental_correct",
]  # fmt: skip


def _names(scope: Scope) -> Callable[[str], dict[str, str]]:
    """The checkpoint alias and the ledger name (``kv_transplant_<name>.csv``) of a panel."""

    def names(panel: str) -> dict[str, str]:
        name = scope.options.get("name") or DEFAULT_NAME[panel]
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise KvreplayError(f"--name {name!r} may hold only letters, digits, '_' and '-'.")
        alias = scope.options.get("alias") or Path(scope.config.model).name
        return {"alias": alias, "name": name}

    return names


def holds_donor(result: BoundaryState, donor: BoundaryState) -> bool:
    """Every layer's K and V of ``result`` is bit-equal to the donor's (a full transplant)."""
    return all(
        a.equal(b)
        for pair_a, pair_b in zip(result.layer_tensors(), donor.layer_tensors(), strict=True)
        for a, b in zip(pair_a, pair_b, strict=True)
    )


class Transplant(Experiment):
    name = "transplant"
    csv_file = "kv_transplant_primary.csv"  # the default; a run's own is in its config
    columns = PAPER_COLUMNS + EXTRA_COLUMNS
    phases = 2

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        panel = scope.options.get("panel", "stratified")
        return select_panel(self.name, panel, scope, rows, _names(scope))

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "precision": scope.dtypes[0],
            "prefix_dtype": PREFIX_DTYPE,
            "arms": list(ARMS),
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
        lm = worker.model(unit.precision)
        prefix = prefix_from_inputs(unit.inputs)
        with clock.model():
            states = {"left": build(lm, prefix, "replay"), "prefill": build(lm, prefix, "prefill")}
        transplants = {
            arm: transplant(states[donor], states[recipient])
            for arm, donor, recipient, _ in TRANSPLANTS
        }
        all_layers = all(
            holds_donor(transplants[arm], states[donor]) for arm, donor, _, _ in TRANSPLANTS
        )
        comparison = compare(states["left"], states["prefill"])
        functional = functional_state_equal([*states.values(), *transplants.values()])
        arms, replicas, disjoint = replicate_and_run(
            worker, lm, unit, states, clock, unreplicated=transplants
        )
        return {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "kind": "transplant",
            "status": "ok",
            "left_construction": "replay",
            "num_layers": lm.num_layers,
            **prefix_record(prefix),
            "prefix_stages": unit.inputs.get("prefix_stages", []),
            "source": unit.inputs.get("source", {}),
            "panel": unit.inputs["panel"],
            "arms": arms,
            "replicas": replicas,
            "comparison": comparison.to_dict(),
            "labels": pair_record(arms["left"], arms["prefill"]),
            "functional_state_equal": functional,
            "all_storage_disjoint": disjoint,
            "all_layers_transplanted": all_layers,
        }

    def csv_rows(self, rows: list[Record]) -> list[dict[str, Any]]:
        by_key = {r.key: r for r in rows}
        out = []
        for record in rows:
            data = record.data
            if data.get("kind") != "transplant":
                continue
            prefix_row_hash = by_key[str(UnitKey.prefix(self.name, data["item_id"]))].row_sha256
            out.append(transplant_csv_row(record, prefix_row_hash))
        return out


def transplant_csv_row(record: Record, prefix_row_hash: str) -> dict[str, str]:
    """Derive one paper-schema row; every flag follows METHOD.md's transplant gates."""
    data = record.data
    arms, replicas, cmp, panel = data["arms"], data["replicas"], data["comparison"], data["panel"]
    native = {arm: arms[arm]["suffix_sha256"] for arm in ("left", "prefill")}
    divergent = native["left"] != native["prefill"]
    recovers = {
        paper: arms[arm]["suffix_sha256"] == native[donor] for arm, donor, _, paper in TRANSPLANTS
    }
    both = all(recovers.values())
    replica_exact = {arm: all(replicas[arm].values()) for arm in ("left", "prefill")}
    historical = panel["historical_stratum"]
    row: dict[str, Any] = {
        "row_id": data["item_id"],
        "source_row_sha256": data["source"].get("row_sha256") or prefix_row_hash,
        "checkpoint_alias": panel["checkpoint_alias"],
        "selection_index": panel["selection_index"],
        "selection_basis": panel["selection_basis"],
        "historical_stratum": historical,
        "historical_stratum_reproduced": historical == "not_used"
        or (historical == "divergent") == divergent,
        "prefix_token_count": data["prefix_token_count"],
        "prefix_sha256": data["prefix_sha256"],
        "incremental_replica_exact": replica_exact["left"],
        "prefill_replica_exact": replica_exact["prefill"],
        "functional_state_equal": data["functional_state_equal"],
        "boundary_argmax_equal": cmp["boundary_argmax_equal"],
        "all_storage_disjoint": data["all_storage_disjoint"],
        "all_48_layer_pairs_transplanted": data["all_layers_transplanted"],
        "incremental_native_suffix_sha256": native["left"],
        "prefill_native_suffix_sha256": native["prefill"],
        "baseline_divergent": divergent,
        "bidirectional_donor_recovery": both,
        "exact_control_novel_trajectory": not divergent and not both,
        "integrity_pass": all(replica_exact.values())
        and data["functional_state_equal"]
        and data["all_storage_disjoint"]
        and data["all_layers_transplanted"],
        "precision": data["precision"],
        "num_layers": data["num_layers"],
        "panel": panel["panel"],
        "prompt_token_count": data["prompt_token_count"],
        "first_suffix_divergence_index": data["labels"]["first_suffix_divergence_index"],
        "incremental_prefill_cache_exact": cmp["cache"]["exact"] and cmp["layer_lengths_equal"],
        "incremental_prefill_logits_exact": cmp["logits"]["exact"],
        "cache_relative_l2_diff": cmp["cache"]["relative_l2_diff"],
        "incremental_correct": arms["left"]["correct"],
        "prefill_correct": arms["prefill"]["correct"],
    }
    for arm, donor, _, paper in TRANSPLANTS:
        row[f"{paper}_suffix_sha256"] = arms[arm]["suffix_sha256"]
        row[f"{paper}_recovers_donor"] = recovers[paper]
        row[f"{paper}_donor_divergence_index"] = first_divergence(
            arms[arm]["suffix_token_ids"], arms[donor]["suffix_token_ids"]
        )
        row[f"{paper}_correct"] = arms[arm]["correct"]
    return {key: csv_value(value) for key, value in row.items()}
