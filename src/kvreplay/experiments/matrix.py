"""The four-arm matrix shared by ``matched`` and ``fixed-prefix``: a left arm (retained
``live`` state, or the ``replay`` rebuild called "incremental" in the paper) against a
one-shot ``prefill``, each with a storage-disjoint replica, all four continued.
"""

from __future__ import annotations

import json
from typing import Any

from kvreplay.construct import build, live
from kvreplay.experiments.base import (
    Clock,
    Unit,
    Workbench,
    csv_value,
    functional_state_equal,
    pair_record,
    prefix_from_inputs,
    prefix_record,
    prompt_ids,
    replicate_and_run,
)
from kvreplay.ledger import Record
from kvreplay.state import compare

L2_COLUMNS = [
    "cache_delta_l2_norm",
    "cache_left_l2_norm",
    "cache_right_l2_norm",
    "cache_relative_l2_diff",
]
EXTRA_COLUMNS = [
    "prompt_token_count",
    "suffix_token_count",
    "first_step_top2_margin",
    "keys_relative_l2_diff",
    "values_relative_l2_diff",
    "cache_relative_l2_by_layer",
]


def matrix_columns(left: str, paper_l2: bool) -> list[str]:
    """The paper's column order for a matrix ledger, then kvreplay's extra columns."""
    replicas = [
        f"{arm}_replica_{what}_exact"
        for arm in (left, "prefill")
        for what in ("cache", "logits", "suffix")
    ]
    l2 = L2_COLUMNS if paper_l2 else []
    return [
        "row_id", "source_row_sha256", "precision", "prefix_token_count", "prefix_sha256",
        *replicas,
        "functional_state_equal", "all_storage_disjoint",
        f"{left}_prefill_cache_exact", "cache_max_abs_diff", "cache_mean_abs_diff", *l2,
        f"{left}_prefill_logits_exact", "logit_max_abs_diff", "logit_mean_abs_diff",
        "boundary_argmax_equal",
        f"{left}_suffix_sha256", f"{left}_replica_suffix_sha256",
        "prefill_suffix_sha256", "prefill_replica_suffix_sha256",
        "suffix_equal", "first_suffix_divergence_index", "trace_equal", "merge_equal",
        "answer_equal", f"{left}_correct", "prefill_correct", "integrity_pass",
        *([] if paper_l2 else L2_COLUMNS),
        f"{left}_answer", "prefill_answer", f"{left}_answer_parsed", "prefill_answer_parsed",
        *EXTRA_COLUMNS,
    ]  # fmt: skip


def run_matrix(worker: Workbench, unit: Unit, clock: Clock, left: str) -> dict[str, Any]:
    """One (item, precision) row. ``left`` is ``live`` or ``replay``."""
    lm = worker.model(unit.precision)
    plan, sampler = worker.config.plan, worker.config.sampler
    if left == "live":
        ids = prompt_ids(worker, lm, unit.item)
        with clock.model():
            left_state, prefix = live(lm, ids, plan, sampler)
        if not prefix.reached:
            return {"status": "unreached", **prefix_record(prefix)}
    else:
        prefix = prefix_from_inputs(unit.inputs)
        with clock.model():
            left_state = build(lm, prefix, "replay")
    with clock.model():
        prefill = build(lm, prefix, "prefill")
    comparison = compare(left_state, prefill)
    functional = functional_state_equal([left_state, prefill])
    arms, replicas, disjoint = replicate_and_run(
        worker, lm, unit, {"left": left_state, "prefill": prefill}, clock, unit.inputs.get("reuse")
    )
    row = {
        "status": "ok",
        "left_construction": left,
        **prefix_record(prefix),
        "source": unit.inputs.get("source", {}),
        "arms": arms,
        "replicas": replicas,
        "comparison": comparison.to_dict(),
        "labels": pair_record(arms["left"], arms["prefill"]),
        "functional_state_equal": functional,
        "all_storage_disjoint": disjoint,
    }
    if left != "live":  # a rebuilt prefix keeps the stages of the generation that made it
        row["prefix_stages"] = unit.inputs.get("prefix_stages", [])
    return row


def integrity(data: dict[str, Any]) -> bool:
    gates = [all(g.values()) for g in data["replicas"].values()]
    return all(gates) and data["functional_state_equal"] and data["all_storage_disjoint"]


def matrix_csv_row(record: Record, left: str, source_sha: str | None = None) -> dict[str, Any]:
    """Derive one paper-schema CSV row from a ledger row."""
    data = record.data
    arms, reps, cmp, labels = data["arms"], data["replicas"], data["comparison"], data["labels"]
    cache, logits = cmp["cache"], cmp["logits"]
    margins = arms["left"]["suffix"]["segments"][0]["margins"]
    row: dict[str, Any] = {
        "row_id": data["item_id"],
        "source_row_sha256": source_sha or record.row_sha256,
        "precision": data["precision"],
        "prefix_token_count": data["prefix_token_count"],
        "prefix_sha256": data["prefix_sha256"],
        "functional_state_equal": data["functional_state_equal"],
        "all_storage_disjoint": data["all_storage_disjoint"],
        f"{left}_prefill_cache_exact": cache["exact"] and cmp["layer_lengths_equal"],
        "cache_max_abs_diff": cache["max_abs_diff"],
        "cache_mean_abs_diff": cache["mean_abs_diff"],
        "cache_delta_l2_norm": cache["delta_l2_norm"],
        "cache_left_l2_norm": cache["left_l2_norm"],
        "cache_right_l2_norm": cache["right_l2_norm"],
        "cache_relative_l2_diff": cache["relative_l2_diff"],
        f"{left}_prefill_logits_exact": logits["exact"],
        "logit_max_abs_diff": logits["max_abs_diff"],
        "logit_mean_abs_diff": logits["mean_abs_diff"],
        "boundary_argmax_equal": cmp["boundary_argmax_equal"],
        "suffix_equal": labels["suffix_equal"],
        "first_suffix_divergence_index": labels["first_suffix_divergence_index"],
        "trace_equal": labels["trace_equal"],
        "merge_equal": labels["merge_equal"],
        "answer_equal": labels["answer_equal"],
        "integrity_pass": integrity(data),
        "prompt_token_count": data["prompt_token_count"],
        "suffix_token_count": len(arms["left"]["suffix_token_ids"]),
        "first_step_top2_margin": round(margins[0], 6) if margins else None,
        "keys_relative_l2_diff": cmp["keys"]["relative_l2_diff"],
        "values_relative_l2_diff": cmp["values"]["relative_l2_diff"],
        "cache_relative_l2_by_layer": json.dumps(
            [round(layer["kv"]["relative_l2_diff"], 9) for layer in cmp["per_layer"]]
        ),
    }
    for arm, name in (("left", left), ("prefill", "prefill")):
        for what in ("cache", "logits", "suffix"):
            row[f"{name}_replica_{what}_exact"] = reps[arm][f"{what}_exact"]
        row[f"{name}_suffix_sha256"] = arms[arm]["suffix_sha256"]
        row[f"{name}_replica_suffix_sha256"] = arms[f"{arm}_replica"]["suffix_sha256"]
        row[f"{name}_correct"] = arms[arm]["correct"]
        row[f"{name}_answer"] = arms[arm]["answer"]
        row[f"{name}_answer_parsed"] = arms[arm]["answer_parsed"]
    return {key: csv_value(value) for key, value in row.items()}
