"""The ``bridge`` CSV (``live_teacher_bridge.csv``): the retained live state vs the
teacher-forced replay of its schedule, over every layer, the boundary logits and the
suffix; the paper's columns, then kvreplay's own."""

from __future__ import annotations

from typing import Any

from kvreplay.core.comparison import Comparison
from kvreplay.harness.columns import Column, Kind, Line, reached_lines, written
from kvreplay.harness.table import Ledger, Table, check_equal_flag

BRIDGE = "bridge"
COMPARED = ("live", "teacher")


def _historical(line: Line) -> dict[str, Any]:
    """The prefix this item had in the historical (``matched``) row; its own without one."""
    return line.row.fields["historical"] or line.row.prefix


def _clone(arm: str, what: str) -> Column[Line]:
    return Column(f"{arm}_clone_{what}", "bool", get=lambda x: getattr(x.row.replicas[arm], what))


def _field(name: str, kind: Kind) -> Column[Line]:
    return Column(name, kind, get=lambda x: x.row.fields[name])


def _boundary_cache(x: Line) -> int:
    """The cache the arms continue from: the state's own in process; in an engine, P's
    cached blocks (the row's field) and the tail every hit recomputes over them."""
    held = int(x.row.fields["boundary_cache_sequence_len"])
    return held + x.row.block_kv["tail_tokens"] if x.row.block_kv else held


def _cmp(x: Line) -> Comparison:
    assert x.row.comparison is not None
    return x.row.comparison


COLUMNS: tuple[Column[Line], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("source_row_sha256", "sha256", get=lambda x: x.source_row_sha256),
    _field("selection_index", "int"),
    Column("new_prefix_token_count", "int", get=lambda x: x.row.prefix["prefix_token_count"]),
    Column("new_prefix_sha256", "sha256", get=lambda x: x.row.prefix["prefix_sha256"]),
    Column(
        "historical_prefix_token_count", "int", get=lambda x: _historical(x)["prefix_token_count"]
    ),
    Column("historical_prefix_sha256", "sha256", get=lambda x: _historical(x)["prefix_sha256"]),
    Column(
        "live_matches_historical_prefix",
        "bool",
        get=lambda x: _historical(x)["prefix_sha256"] == x.row.prefix["prefix_sha256"],
    ),
    Column("boundary_cache_sequence_len", "int", get=_boundary_cache),
    Column(
        "post_decode_cache_sequence_len",
        "int",
        get=lambda x: x.row.arms["live"].post_decode_cache_len,
    ),
    _clone("live", "cache_exact"),
    _clone("live", "logits_exact"),
    _clone("teacher", "cache_exact"),
    _clone("teacher", "logits_exact"),
    Column("functional_state_equal", "bool", get=lambda x: x.row.functional_state_equal),
    Column("all_storage_disjoint", "bool", get=lambda x: x.row.all_storage_disjoint),
    Column("live_teacher_cache_exact", "bool", get=lambda x: _cmp(x).cache_exact),
    Column("live_teacher_logits_exact", "bool", get=lambda x: _cmp(x).logits["exact"]),
    Column("boundary_argmax_equal", "bool", get=lambda x: _cmp(x).boundary_argmax_equal),
    Column("live_suffix_sha256", "sha256", get=lambda x: x.row.arms["live"].suffix_sha256),
    Column("teacher_suffix_sha256", "sha256", get=lambda x: x.row.arms["teacher"].suffix_sha256),
    Column("live_teacher_suffix_exact", "bool", get=lambda x: not x.row.diverges),
    Column(
        "all_48_layers_exact",
        "bool",
        get=lambda x: all(layer["kv"]["exact"] for layer in _cmp(x).per_layer),
    ),
    Column("integrity_pass", "bool", get=lambda x: x.row.integrity_pass),
    *written(
        Column("precision", "text", get=lambda x: x.row.precision),
        _field("num_layers", "int"),
        Column(
            "historical_source",
            "text",
            get=lambda x: (x.row.fields["historical"] or {"key": "none"})["key"],
        ),
        Column(
            "first_suffix_divergence_index",
            "optional_int",
            get=lambda x: x.row.labels.first_suffix_divergence_index,
        ),
    ),
)


def _check_lengths(ledger: Ledger) -> None:
    """Gate: the boundary cache covers exactly the new prefix and decoding only grows it."""
    boundary = ledger["boundary_cache_sequence_len"]
    ledger.require(
        boundary == ledger["new_prefix_token_count"],
        "boundary_cache_sequence_len",
        "it must equal new_prefix_token_count",
    )
    ledger.require(
        ledger["post_decode_cache_sequence_len"] >= boundary,
        "post_decode_cache_sequence_len",
        "it must not be smaller than boundary_cache_sequence_len",
    )


BRIDGE_TABLE = Table(
    "live_teacher_bridge.csv",
    COLUMNS,
    BRIDGE,
    reached_lines(COMPARED),
    checks=(_check_lengths,),
    line_checks=(
        check_equal_flag(
            "live_teacher_suffix_exact", "live_suffix_sha256", "teacher_suffix_sha256"
        ),
    ),
)
