"""``bridge``: the retained live state vs the teacher-forced replay of its schedule, over
every layer, the boundary logits and the suffix (``live_teacher_bridge.csv``).

Items are chosen outcome-blind, spread over prefix length: order statistics of the
lengths known before any bridge row runs (this run's ``matched`` prefixes when present,
else prompt lengths), recorded in the manifest before the first row.
"""

from __future__ import annotations

from typing import Any

from kvreplay.construct import build, live
from kvreplay.experiments.base import (
    Clock,
    Experiment,
    Outcome,
    Scope,
    Selection,
    Unit,
    UnitKey,
    Workbench,
    csv_value,
    functional_state_equal,
    planned_keys,
    prefix_record,
    prompt_ids,
    run_arm,
)
from kvreplay.experiments.matched import MATCHED
from kvreplay.experiments.panel import prompt_lengths, spread_selection
from kvreplay.items import Item
from kvreplay.ledger import Record
from kvreplay.state import compare, first_divergence, make_replica, storage_disjoint

COLUMNS = [
    "row_id", "source_row_sha256", "selection_index",
    "new_prefix_token_count", "new_prefix_sha256",
    "historical_prefix_token_count", "historical_prefix_sha256",
    "live_matches_historical_prefix",
    "boundary_cache_sequence_len", "post_decode_cache_sequence_len",
    "live_clone_cache_exact", "live_clone_logits_exact",
    "teacher_clone_cache_exact", "teacher_clone_logits_exact",
    "functional_state_equal", "all_storage_disjoint",
    "live_teacher_cache_exact", "live_teacher_logits_exact", "boundary_argmax_equal",
    "live_suffix_sha256", "teacher_suffix_sha256", "live_teacher_suffix_exact",
    "all_48_layers_exact", "integrity_pass",
    "precision", "num_layers", "historical_source", "first_suffix_divergence_index",
]  # fmt: skip


class Bridge(Experiment):
    name = "bridge"
    csv_file = "live_teacher_bridge.csv"
    columns = COLUMNS
    compared = ("live", "replay")

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
                inputs["reuse"] = {"key": historical.key, "arm": historical.data["arms"]["left"]}
            units.append(Unit(UnitKey(self.name, item.id, dtype), item, dtype, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], [config["dtype"]], rows)

    def outcome(self, data: dict[str, Any]) -> Outcome:
        live, teacher = data["arms"]["live"], data["arms"]["teacher"]
        return Outcome(
            suffix_equal=live["suffix_sha256"] == teacher["suffix_sha256"],
            answer_equal=live["answer"] == teacher["answer"],
            correct=(live["correct"], teacher["correct"]),
            parsed=(live["answer_parsed"], teacher["answer_parsed"]),
            replicas_exact=all(
                all(data[clone].values()) for clone in ("live_clone", "teacher_clone")
            ),
        )

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        lm = worker.model(unit.precision)
        base = {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "selection_index": unit.inputs["selection_index"],
            "num_layers": lm.num_layers,
        }
        with clock.model():
            live_state, prefix = live(
                lm, prompt_ids(worker, lm, unit.item), worker.config.plan, worker.config.sampler
            )
        if not prefix.reached:
            return {**base, "status": "unreached", **prefix_record(prefix)}
        with clock.model():
            teacher = build(lm, prefix, "replay")
        live_clone, live_check = make_replica(live_state)
        teacher_clone, teacher_check = make_replica(teacher)
        states = [live_state, teacher, live_clone, teacher_clone]
        disjoint = all(
            storage_disjoint(a, b) for i, a in enumerate(states) for b in states[i + 1 :]
        )
        comparison = compare(live_state, teacher)
        boundary_len = max(live_state.layer_lengths())
        functional = functional_state_equal(states)  # before run_arm advances the states
        arms = {
            "live": run_arm(worker, lm, unit, "live", live_state, clock, unit.inputs.get("reuse")),
            "teacher": run_arm(worker, lm, unit, "teacher", teacher, clock),
        }
        return {
            **base,
            "status": "ok",
            **prefix_record(prefix),
            "historical": unit.inputs.get("historical"),
            "boundary_cache_sequence_len": boundary_len,
            "live_clone": {
                "cache_exact": live_check.cache_exact,
                "logits_exact": live_check.logits_exact,
            },
            "teacher_clone": {
                "cache_exact": teacher_check.cache_exact,
                "logits_exact": teacher_check.logits_exact,
            },
            "functional_state_equal": functional,
            "all_storage_disjoint": disjoint,
            "comparison": comparison.to_dict(),
            "arms": arms,
        }

    def csv_rows(self, rows: list[Record]) -> list[dict[str, Any]]:
        out = []
        for record in rows:
            data = record.data
            if data["status"] != "ok":
                continue
            cmp, arms = data["comparison"], data["arms"]
            historical = data["historical"] or {
                "prefix_token_count": data["prefix_token_count"],
                "prefix_sha256": data["prefix_sha256"],
            }
            suffix_exact = arms["live"]["suffix_sha256"] == arms["teacher"]["suffix_sha256"]
            clones = [data["live_clone"], data["teacher_clone"]]
            row = {
                "row_id": data["item_id"],
                "source_row_sha256": record.row_sha256,
                "selection_index": data["selection_index"],
                "new_prefix_token_count": data["prefix_token_count"],
                "new_prefix_sha256": data["prefix_sha256"],
                "historical_prefix_token_count": historical["prefix_token_count"],
                "historical_prefix_sha256": historical["prefix_sha256"],
                "live_matches_historical_prefix": historical["prefix_sha256"]
                == data["prefix_sha256"],
                "boundary_cache_sequence_len": data["boundary_cache_sequence_len"],
                "post_decode_cache_sequence_len": arms["live"]["post_decode_cache_len"],
                "live_clone_cache_exact": data["live_clone"]["cache_exact"],
                "live_clone_logits_exact": data["live_clone"]["logits_exact"],
                "teacher_clone_cache_exact": data["teacher_clone"]["cache_exact"],
                "teacher_clone_logits_exact": data["teacher_clone"]["logits_exact"],
                "functional_state_equal": data["functional_state_equal"],
                "all_storage_disjoint": data["all_storage_disjoint"],
                "live_teacher_cache_exact": cmp["cache"]["exact"] and cmp["layer_lengths_equal"],
                "live_teacher_logits_exact": cmp["logits"]["exact"],
                "boundary_argmax_equal": cmp["boundary_argmax_equal"],
                "live_suffix_sha256": arms["live"]["suffix_sha256"],
                "teacher_suffix_sha256": arms["teacher"]["suffix_sha256"],
                "live_teacher_suffix_exact": suffix_exact,
                "all_48_layers_exact": all(layer["kv"]["exact"] for layer in cmp["per_layer"]),
                "integrity_pass": all(all(c.values()) for c in clones)
                and data["functional_state_equal"]
                and data["all_storage_disjoint"],
                "precision": data["precision"],
                "num_layers": data["num_layers"],
                "historical_source": data["historical"]["key"] if data["historical"] else "none",
                "first_suffix_divergence_index": first_divergence(
                    arms["live"]["suffix_token_ids"], arms["teacher"]["suffix_token_ids"]
                ),
            }
            out.append({key: csv_value(value) for key, value in row.items()})
        return out
