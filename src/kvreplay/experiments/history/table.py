"""The ``history`` CSV (``history_hit_miss.csv``): per item and precision, the same hit
request after different histories of how P's blocks were written, beside the miss and
the hit under background traffic. Each arm's suffix, the cached tokens its first request
read and the ones its history wrote, whether it equals the hit and the miss, and the load
the server reported while the traffic arm ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.core.comparison import first_divergence
from kvreplay.harness.columns import Column, Kind, Line, reached_lines, written
from kvreplay.harness.rows import ArmResult, replica_name
from kvreplay.harness.table import Table, check_equal_flag

HISTORY = "history"
COMPARED = ("hit", "miss")
HISTORIES = ("traffic", "warm", "evicted")
"""The arms beside the compared pair: the hit under traffic, after a warm prefill, after
an eviction."""
LOAD = (
    ("clients", "optional_int"),
    ("sent", "optional_int"),
    ("failed", "optional_int"),
    ("in_flight_max", "optional_int"),
    ("server_running_max", "optional_float"),
    ("server_waiting_max", "optional_float"),
    ("kv_cache_usage_max", "optional_float"),
    ("preemptions", "optional_float"),
)
"""The traffic arm's load (:class:`~kvreplay.backends.traffic.Load`), as columns."""


def _arm(x: Line, arm: str) -> ArmResult | None:
    return x.row.arms.get(arm)


def _served(arm: str, field: str) -> Callable[[Line], Any]:
    def get(x: Line) -> Any:
        result = _arm(x, arm)
        return None if result is None else getattr(result.served, field)

    return get


def _served_sha(arm: str) -> Callable[[Line], str | None]:
    def get(x: Line) -> str | None:
        result = _arm(x, arm)
        return None if result is None else result.suffix_sha256

    return get


def _cached(arm: str) -> Callable[[Line], int | None]:
    def get(x: Line) -> int | None:
        result = _arm(x, arm)
        return None if result is None else result.served.cached_tokens[0]  # type: ignore[union-attr]

    return get


def _equal(arm: str, other: str) -> Callable[[Line], bool | None]:
    def get(x: Line) -> bool | None:
        result = _arm(x, arm)
        return None if result is None else result.suffix_sha256 == x.row.arms[other].suffix_sha256

    return get


def _load(field: str) -> Callable[[Line], Any]:
    def get(x: Line) -> Any:
        result = _arm(x, "traffic")
        load = None if result is None else result.served.load  # type: ignore[union-attr]
        return None if load is None else load[field]

    return get


def _arm_columns(arm: str) -> list[Column[Line]]:
    kind: Kind = "sha256" if arm in COMPARED else "optional_sha256"
    columns = [
        Column(f"{arm}_suffix_sha256", kind, get=_served_sha(arm)),
        Column(f"{arm}_cached_tokens", "optional_int", get=_cached(arm)),
        Column(f"{arm}_expected_cached_tokens", "optional_int",
               get=_served(arm, "expected_cached_tokens")),
        Column(f"{arm}_read", "optional_text", get=_served(arm, "read")),
    ]  # fmt: skip
    if arm != "hit":
        columns.append(Column(f"{arm}_equal_hit", "optional_bool", get=_equal(arm, "hit")))
    if arm != "miss":
        columns.append(Column(f"{arm}_equal_miss", "optional_bool", get=_equal(arm, "miss")))
    return columns


COLUMNS: tuple[Column[Line], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("source_row_sha256", "sha256", get=lambda x: x.source_row_sha256),
    Column("precision", "text", get=lambda x: x.row.precision),
    Column("backend", "text", get=lambda x: x.row.fields["backend"]),
    Column("prefix_token_count", "int", get=lambda x: x.row.prefix["prefix_token_count"]),
    Column("prefix_sha256", "sha256", get=lambda x: x.row.prefix["prefix_sha256"]),
    *(column for arm in (*COMPARED, *HISTORIES) for column in _arm_columns(arm)),
    Column("suffix_equal", "bool", get=lambda x: x.row.labels.suffix_equal),
    Column("first_suffix_divergence_index", "optional_int",
           get=lambda x: first_divergence(x.row.left.suffix_token_ids,
                                          x.row.right.suffix_token_ids)),
    Column("evicted_tokens", "optional_int", get=_served("evicted", "evicted_tokens")),
    *(Column(f"traffic_{name}", kind, get=_load(name)) for name, kind in LOAD),  # type: ignore[arg-type]
    *(
        Column(f"{replica_name(arm)}_suffix_exact", "bool",
               get=lambda x, a=arm: x.row.replicas[a].suffix_exact)
        for arm in COMPARED
    ),
    Column("integrity_pass", "bool", get=lambda x: x.row.integrity_pass),
    *written(Column("prompt_token_count", "int", get=lambda x: x.row.prefix["prompt_token_count"])),
)  # fmt: skip

HISTORY_TABLE = Table(
    "history_hit_miss.csv",
    COLUMNS,
    HISTORY,
    reached_lines(COMPARED),
    ("precision", "row_id"),
    marker="backend",
    line_checks=(check_equal_flag("suffix_equal", "hit_suffix_sha256", "miss_suffix_sha256"),),
)
