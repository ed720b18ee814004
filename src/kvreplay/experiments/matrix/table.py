"""The matrix CSVs: ``matched`` (``matched_live_prefill.csv``) and ``fixed-prefix``
(``fixed_prefix_2x2.csv``). Each holds the paper's columns in its order, then kvreplay's
own; only the left arm's name differs (the retained ``live`` state, or the ``replay``
rebuild the paper calls "incremental"). A served ``matched`` row (a backend without K/V
access, named in its ``backend`` column) leaves the K/V columns empty and adds the
engine's measures."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from kvreplay.core.comparison import Comparison, first_divergence
from kvreplay.harness.columns import (
    Column,
    Kind,
    Line,
    kv,
    optional,
    prefix_row_hashes,
    written,
)
from kvreplay.harness.rows import ArmResult, PanelRow, replica_name
from kvreplay.harness.table import Ledger, LedgerError, LineCheck, Table, check_equal_flag
from kvreplay.harness.units import UnitKey
from kvreplay.ledger import Record, heads

MATCHED = "matched"
FIXED_PREFIX = "fixed-prefix"
COMPARED = ("left", "prefill")  # the compared arms of every matrix row
LAYER_DRIFT = "cache_relative_l2_by_layer"
SERVED_CONTROLS = {
    "uninterrupted_equal_live": "uninterrupted request vs cache hit",
    "uninterrupted_equal_prefill": "uninterrupted request vs cache miss",
    "batched_equal_live": "hit with companions vs hit alone",
}
"""A served row's controls and what each compares: empty where the plan or the item set
leaves the arm out."""


def _replica_columns(left: str) -> list[Column[Line]]:
    return [
        Column(
            f"{replica_name(name)}_{what}",
            "bool",
            get=lambda x, a=arm, w=what: getattr(x.row.replicas[a], w),
        )
        for arm, name in (("left", left), ("prefill", "prefill"))
        for what in ("cache_exact", "logits_exact", "suffix_exact")
    ]


def _suffix_sha256(name: str, arm: str) -> Column[Line]:
    """A suffix digest: its agreements are the flags the line checks hold to it."""
    return Column(
        f"{name}_suffix_sha256", "sha256", held=False, get=lambda x: x.row.arms[arm].suffix_sha256
    )


def _label(name: str, kind: Kind = "bool") -> Column[Line]:
    return Column(name, kind, get=lambda x: getattr(x.row.labels, name))


def _l2_columns() -> list[Column[Line]]:
    return [
        Column(f"cache_{what}", "float", get=kv(lambda c, w=what: c.cache[w]))
        for what in ("delta_l2_norm", "left_l2_norm", "right_l2_norm", "relative_l2_diff")
    ]


def _arm_columns(left: str, field: str, kind: Kind) -> list[Column[Line]]:
    return [
        Column(f"{name}_{field}", kind, get=lambda x, a=arm: getattr(x.row.arms[a], field))
        for arm, name in (("left", left), ("prefill", "prefill"))
    ]


def matrix_columns(left: str, paper_l2: bool) -> list[Column[Line]]:
    """The paper's columns of a matrix ledger, in its order, then kvreplay's extra
    columns; ``left`` is the left arm's name in the paper (``live``, ``incremental``)."""
    l2 = _l2_columns()
    return [
        Column("row_id", "text", get=lambda x: x.row.item_id),
        Column("source_row_sha256", "sha256", held=False, get=lambda x: x.source_row_sha256),
        Column("precision", "text", get=lambda x: x.row.precision),
        Column("prefix_token_count", "int", get=lambda x: x.row.prefix["prefix_token_count"]),
        Column("prefix_sha256", "sha256", get=lambda x: x.row.prefix["prefix_sha256"]),
        *_replica_columns(left),
        Column("functional_state_equal", "bool", get=lambda x: x.row.functional_state_equal),
        Column("all_storage_disjoint", "bool", get=lambda x: x.row.all_storage_disjoint),
        Column(f"{left}_prefill_cache_exact", "bool", get=kv(lambda c: c.cache_exact)),
        Column("cache_max_abs_diff", "float", get=kv(lambda c: c.cache["max_abs_diff"])),
        Column("cache_mean_abs_diff", "float", get=kv(lambda c: c.cache["mean_abs_diff"])),
        *(l2 if paper_l2 else []),
        Column(f"{left}_prefill_logits_exact", "bool", get=_logits_exact),
        Column("logit_max_abs_diff", "float", get=kv(lambda c: c.logits["max_abs_diff"])),
        Column("logit_mean_abs_diff", "float", get=kv(lambda c: c.logits["mean_abs_diff"])),
        Column("boundary_argmax_equal", "bool", get=lambda x: x.row.boundary_argmax_equal),
        _suffix_sha256(left, "left"),
        _suffix_sha256(replica_name(left), replica_name("left")),
        _suffix_sha256("prefill", "prefill"),
        _suffix_sha256(replica_name("prefill"), replica_name("prefill")),
        _label("suffix_equal"),
        _label("first_suffix_divergence_index", "optional_int"),
        *(_label(name) for name in ("trace_equal", "merge_equal", "answer_equal")),
        *_arm_columns(left, "correct", "bool"),
        Column("integrity_pass", "bool", get=lambda x: x.row.integrity_pass),
        *([] if paper_l2 else written(*l2)),
        *written(*_arm_columns(left, "answer", "optional_text")),
        *written(*_arm_columns(left, "answer_parsed", "bool")),
        *written(
            Column("prompt_token_count", "int", get=lambda x: x.row.prefix["prompt_token_count"]),
            Column("suffix_token_count", "int", get=lambda x: len(x.row.left.suffix_token_ids)),
            Column("first_step_top2_margin", "optional_float",
                   get=lambda x: _rounded(x.row.left.first_step_margin)),
            Column("keys_relative_l2_diff", "float",
                   get=kv(lambda c: c.keys["relative_l2_diff"])),
            Column("values_relative_l2_diff", "float",
                   get=kv(lambda c: c.values["relative_l2_diff"])),
        ),
        Column(LAYER_DRIFT, "float_list", "optional", held=False, get=kv(_by_layer)),
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


def first_token_logprob_diff(left: ArmResult, right: ArmResult) -> float | None:
    """|logprob| difference of the left arm's first token between the two arms, where
    both engines listed it among their top logprobs."""
    assert left.served is not None and right.served is not None
    lefts = {t: lp for t, lp in left.served.first_logprobs}
    rights = {t: lp for t, lp in right.served.first_logprobs}
    token = left.boundary_argmax
    if token not in lefts or token not in rights:
        return None
    return abs(lefts[token] - rights[token])


def _cached(arm: str) -> Callable[[Line], int]:
    return lambda x: x.row.arms[arm].served.cached_tokens[0]  # type: ignore[union-attr]


def _equal(arm: str, other: str) -> Callable[[Line], bool | None]:
    """Suffixes equal; empty where the arm did not run or followed another P."""

    def get(x: Line) -> bool | None:
        arms = x.row.arms
        if arm not in arms or arms[arm].served.prefix_reproduced is False:  # type: ignore[union-attr]
            return None
        return arms[arm].suffix_sha256 == arms[other].suffix_sha256

    return get


def _sha(arm: str) -> Callable[[Line], str | None]:
    return lambda x: x.row.arms[arm].suffix_sha256 if arm in x.row.arms else None


def _companions(x: Line) -> str | None:
    batched = x.row.arms.get("batched")
    return None if batched is None else json.dumps(batched.served.companions)  # type: ignore[union-attr]


def _divergence(x: Line) -> int | None:
    return first_divergence(x.row.left.suffix_token_ids, x.row.right.suffix_token_ids)


def served_columns(left: str) -> list[Column[Line]]:
    """A served row's columns: the matrix's, with the K/V ones it leaves empty no longer
    read, then the engine's cached tokens and logprob-based measures."""
    kv_only = {
        *(f"{replica_name(arm)}_cache_exact" for arm in (left, "prefill")),
        *("functional_state_equal", "all_storage_disjoint", f"{left}_prefill_cache_exact"),
        *(f"{part}_{what}_abs_diff" for part in ("cache", "logit") for what in ("max", "mean")),
        *(c.name for c in _l2_columns()),
        *("keys_relative_l2_diff", "values_relative_l2_diff", LAYER_DRIFT),
    }
    matrix = [
        replace(c, kind=optional(c.kind), use="written") if c.name in kv_only else c
        for c in matrix_columns(left, paper_l2=False)
    ]
    return matrix + [
        Column("backend", "text", get=lambda x: x.row.fields["backend"]),
        Column("live_cached_tokens", "int", get=_cached("left")),
        Column("prefill_cached_tokens", "int", get=_cached("prefill")),
        *written(
            Column("first_token_logprob_diff", "optional_float",
                   get=lambda x: first_token_logprob_diff(x.row.left, x.row.right)),
            Column("live_margin_at_divergence", "optional_float",
                   get=lambda x: x.row.left.margin_at(_divergence(x))),
            Column("prefill_margin_at_divergence", "optional_float",
                   get=lambda x: x.row.right.margin_at(_divergence(x))),
            Column("uninterrupted_suffix_sha256", "optional_sha256", get=_sha("uninterrupted")),
        ),
        Column("uninterrupted_equal_live", "optional_bool", get=_equal("uninterrupted", "left")),
        Column("uninterrupted_equal_prefill", "optional_bool",
               get=_equal("uninterrupted", "prefill")),
        Column("batched_suffix_sha256", "optional_sha256", "written", get=_sha("batched")),
        Column("batched_equal_live", "optional_bool", get=_equal("batched", "left")),
        Column("batch_companions", "optional_json", "written", get=_companions),
    ]  # fmt: skip


def matched_lines(rows: Iterable[Record]) -> Iterator[Line]:
    """Rows of items that reached the boundary at every precision (which items those
    are from the rows' heads, then their lines).

    Live generation may reach the boundary at one precision and not another; the paper's
    ledger pairs precisions row by row, so such items stay in rows.jsonl and in the run
    summary (as unreached) but not in the CSV.
    """
    bits: dict[str, int] = {}  # a bit for each precision
    reached: dict[str, int] = {}  # each item's precisions, as bits: an int, not a set
    for r in heads(rows):
        if r.data.get("kind") == "prefix":  # --select fragile's screens
            continue
        bit = bits.setdefault(r.data["precision"], 1 << len(bits))
        if r.data["status"] == "ok":
            reached[r.data["item_id"]] = reached.get(r.data["item_id"], 0) | bit
    every = (1 << len(bits)) - 1
    return (
        Line(PanelRow.from_dict(r.data, COMPARED), r.row_sha256)
        for r in rows
        if r.data.get("kind") != "prefix" and reached.get(r.data["item_id"]) == every
    )


def fixed_prefix_lines(rows: Iterable[Record]) -> Iterator[Line]:
    """Matrix rows that reached the boundary, sourced from their recorded prefix (the
    prefix rows' hashes from the rows' heads, then the lines)."""
    prefixes = prefix_row_hashes(rows)
    for record in rows:
        if record.data.get("kind") != "matrix" or record.data["status"] != "ok":
            continue
        prefix = prefixes[str(UnitKey.prefix(FIXED_PREFIX, record.data["item_id"]))]
        source = record.data["source"].get("row_sha256") or prefix
        yield Line(PanelRow.from_dict(record.data, COMPARED), source)


def _check_divergence_index(
    line: Mapping[str, Any], _first: Mapping[str, Any]
) -> tuple[str, str] | None:
    if math.isnan(line["first_suffix_divergence_index"]) == line["suffix_equal"]:
        return None
    return "first_suffix_divergence_index", "it must be empty exactly when suffix_equal is true"


def _check_layer_drift(line: Mapping[str, Any], first: Mapping[str, Any]) -> tuple[str, str] | None:
    if LAYER_DRIFT not in line or len(line[LAYER_DRIFT]) == len(first[LAYER_DRIFT]):
        return None
    layers = len(first[LAYER_DRIFT])
    return LAYER_DRIFT, f"it must hold {layers} values, one per layer, like the first row"


def check_cross_precision_pairing(ledger: Ledger) -> None:
    """Gate: bf16 and fp32 rows are paired by order, so they must list the same row ids."""
    bf16 = ledger.row_ids[ledger["precision"] == "bf16"]
    fp32 = ledger.row_ids[ledger["precision"] == "fp32"]
    if not bf16.size or not fp32.size:
        return
    common = min(bf16.size, fp32.size)
    mismatch = np.flatnonzero(bf16[:common] != fp32[:common])
    if mismatch.size or bf16.size != fp32.size:
        position = int(mismatch[0]) if mismatch.size else common
        row = fp32[position] if position < fp32.size else bf16[position]
        problem = "the fp32 rows must list the same row ids in the same order as the bf16 rows"
        raise LedgerError(ledger.file, problem, str(row), "row_id")


def _line_checks(left: str) -> tuple[LineCheck, ...]:
    return (
        check_equal_flag("suffix_equal", f"{left}_suffix_sha256", "prefill_suffix_sha256"),
        *(
            check_equal_flag(
                f"{replica_name(arm)}_suffix_exact",
                f"{arm}_suffix_sha256",
                f"{replica_name(arm)}_suffix_sha256",
            )
            for arm in (left, "prefill")
        ),
        _check_divergence_index,
        _check_layer_drift,
    )


def _table(
    file: str, experiment: str, lines: Callable[[Iterable[Record]], Iterator[Line]], left: str
) -> Table:
    """A matrix table; the paper's fixed-prefix ledger has the L2 norms among its columns."""
    columns = matrix_columns(left, paper_l2=experiment == FIXED_PREFIX)
    return Table(
        file,
        tuple(columns),
        experiment,
        lines,
        ("precision", "row_id"),
        (check_cross_precision_pairing,),
        line_checks=_line_checks(left),
    )


MATCHED_TABLE = _table("matched_live_prefill.csv", MATCHED, matched_lines, "live")
SERVED_MATCHED_TABLE = replace(
    MATCHED_TABLE, columns=tuple(served_columns("live")), marker="backend"
)
FIXED_PREFIX_TABLE = _table("fixed_prefix_2x2.csv", FIXED_PREFIX, fixed_prefix_lines, "incremental")
