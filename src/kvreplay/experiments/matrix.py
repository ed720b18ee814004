"""The four-arm matrix shared by ``matched`` and ``fixed-prefix``: a left arm (the
retained ``live`` state, or the ``replay`` rebuild the paper calls "incremental") against
a one-shot ``prefill``, each with a storage-disjoint replica, all four continued.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvreplay.comparison import Comparison
from kvreplay.experiments.columns import Column, Line, kv
from kvreplay.experiments.panel import Arm, Panel, run_panel
from kvreplay.experiments.units import Clock, Unit, Workbench


def matrix_panel(left: str) -> Panel:
    """The matrix's arms: ``left`` (``live`` or ``replay``) and ``prefill``, replicated."""
    return Panel((Arm("left", left), Arm("prefill", "prefill")))


def run_matrix(worker: Workbench, unit: Unit, clock: Clock, panel: Panel) -> dict[str, Any]:
    """One (item, precision) row, or an unreached one when live generation stopped short."""
    result = run_panel(worker, unit, clock, panel)
    row = result.row
    if row is None:
        return {"status": "unreached", **result.prefix}
    row.fields = {
        "left_construction": panel.arms[0].construction,
        "source": unit.inputs.get("source", {}),
        "labels": row.labels.to_dict(),
    }
    return row.to_dict()


def _replica_columns(left: str) -> list[Column[Line]]:
    return [
        Column(f"{name}_replica_{what}", lambda x, a=arm, w=what: getattr(x.row.replicas[a], w))
        for arm, name in (("left", left), ("prefill", "prefill"))
        for what in ("cache_exact", "logits_exact", "suffix_exact")
    ]


def _suffix_sha256(arm: str) -> Callable[[Line], str]:
    return lambda x: x.row.arms[arm].suffix_sha256


def _label(name: str) -> Callable[[Line], Any]:
    return lambda x: getattr(x.row.labels, name)


def _l2_columns() -> list[Column[Line]]:
    return [
        Column(f"cache_{what}", kv(lambda c, w=what: c.cache[w]))
        for what in ("delta_l2_norm", "left_l2_norm", "right_l2_norm", "relative_l2_diff")
    ]


def _arm_columns(left: str, field: str) -> list[Column[Line]]:
    return [
        Column(f"{name}_{field}", lambda x, a=arm: getattr(x.row.arms[a], field))
        for arm, name in (("left", left), ("prefill", "prefill"))
    ]


def matrix_columns(left: str, paper_l2: bool) -> list[Column[Line]]:
    """The paper's columns of a matrix ledger, in its order, then kvreplay's extra
    columns; ``left`` is the left arm's name in the paper (``live``, ``incremental``)."""
    l2 = _l2_columns()
    return [
        Column("row_id", lambda x: x.row.item_id),
        Column("source_row_sha256", lambda x: x.source_row_sha256),
        Column("precision", lambda x: x.row.precision),
        Column("prefix_token_count", lambda x: x.row.prefix["prefix_token_count"]),
        Column("prefix_sha256", lambda x: x.row.prefix["prefix_sha256"]),
        *_replica_columns(left),
        Column("functional_state_equal", lambda x: x.row.functional_state_equal),
        Column("all_storage_disjoint", lambda x: x.row.all_storage_disjoint),
        Column(f"{left}_prefill_cache_exact", kv(lambda c: c.cache_exact)),
        Column("cache_max_abs_diff", kv(lambda c: c.cache["max_abs_diff"])),
        Column("cache_mean_abs_diff", kv(lambda c: c.cache["mean_abs_diff"])),
        *(l2 if paper_l2 else []),
        Column(f"{left}_prefill_logits_exact", _logits_exact),
        Column("logit_max_abs_diff", kv(lambda c: c.logits["max_abs_diff"])),
        Column("logit_mean_abs_diff", kv(lambda c: c.logits["mean_abs_diff"])),
        Column("boundary_argmax_equal", lambda x: x.row.boundary_argmax_equal),
        Column(f"{left}_suffix_sha256", _suffix_sha256("left")),
        Column(f"{left}_replica_suffix_sha256", _suffix_sha256("left_replica")),
        Column("prefill_suffix_sha256", _suffix_sha256("prefill")),
        Column("prefill_replica_suffix_sha256", _suffix_sha256("prefill_replica")),
        *(Column(name, _label(name)) for name in ("suffix_equal", "first_suffix_divergence_index",
                                                   "trace_equal", "merge_equal", "answer_equal")),
        *_arm_columns(left, "correct"),
        Column("integrity_pass", lambda x: x.row.integrity_pass),
        *([] if paper_l2 else l2),
        *_arm_columns(left, "answer"),
        *_arm_columns(left, "answer_parsed"),
        Column("prompt_token_count", lambda x: x.row.prefix["prompt_token_count"]),
        Column("suffix_token_count", lambda x: len(x.row.left.suffix_token_ids)),
        Column("first_step_top2_margin", lambda x: _rounded(x.row.left.first_step_margin)),
        Column("keys_relative_l2_diff", kv(lambda c: c.keys["relative_l2_diff"])),
        Column("values_relative_l2_diff", kv(lambda c: c.values["relative_l2_diff"])),
        Column("cache_relative_l2_by_layer", kv(_by_layer)),
    ]  # fmt: skip


def _logits_exact(x: Line) -> bool:
    """Boundary logits bit-equal; on a served row, the first step's top logprobs."""
    if x.row.comparison is not None:
        return x.row.comparison.logits["exact"]
    return x.row.left.logits_fingerprint == x.row.right.logits_fingerprint


def _rounded(margin: float | None) -> float | None:
    return None if margin is None else round(margin, 6)


def _by_layer(comparison: Comparison) -> str:
    return json.dumps([round(value, 9) for value in comparison.relative_l2_by_layer()])
