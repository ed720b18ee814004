"""The ``transplant`` CSV (``kv_transplant_<name>.csv``): the six-arm panel behind the
paper's causal claim. Every flag follows the paper's published transplant gates: a
transplant recovers its donor when its suffix equals the donor's own, token for token."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from kvreplay.harness.columns import Column, Kind, Line, prefix_row_hashes, written
from kvreplay.harness.rows import PairLabels, PanelRow
from kvreplay.harness.table import Check, Ledger, LineCheck, Table, check_equal_flag
from kvreplay.harness.units import UnitKey
from kvreplay.ledger import Record

TRANSPLANT = "transplant"
COMPARED = ("left", "prefill")
PAPER_ARMS = {"left": "incremental", "prefill": "prefill"}  # the paper's name of each arm


class Swap(NamedTuple):
    """A transplanted arm: the recipient arm's state carrying every K/V layer of the
    donor arm's, named in rows and, differently, in the paper."""

    name: str
    donor: str
    recipient: str
    paper: str


SWAPS = (
    Swap("replay_cache_into_prefill", "left", "prefill", "incremental_cache_into_prefill"),
    Swap("prefill_cache_into_replay", "prefill", "left", "prefill_cache_into_incremental"),
)
INTEGRITY_COLUMNS = (
    "incremental_replica_exact",
    "prefill_replica_exact",
    "functional_state_equal",
    "all_storage_disjoint",
    "all_48_layer_pairs_transplanted",
    "integrity_pass",
)


def recovers(swap: Swap) -> str:
    """The column that says whether a transplant recovers its donor."""
    return f"{swap.paper}_recovers_donor"


def recovers_donor(line: Line, swap: Swap) -> bool:
    arms = line.row.arms
    return arms[swap.name].suffix_sha256 == arms[swap.donor].suffix_sha256


def donor_divergence_index(line: Line, swap: Swap) -> int | None:
    arms = line.row.arms
    return PairLabels.of(arms[swap.name], arms[swap.donor]).first_suffix_divergence_index


def bidirectional(line: Line) -> bool:
    return all(recovers_donor(line, swap) for swap in SWAPS)


def stratum_reproduced(line: Line) -> bool:
    historical = line.row.fields["panel"]["historical_stratum"]
    return historical == "not_used" or (historical == "divergent") == line.row.diverges


def _swaps(what: str, kind: Kind, get: Callable[[Line, Swap], Any]) -> list[Column[Line]]:
    return [Column(f"{s.paper}_{what}", kind, get=lambda x, s=s: get(x, s)) for s in SWAPS]


def _panel(field: str, kind: Kind) -> Column[Line]:
    return Column(field, kind, get=lambda x: x.row.fields["panel"][field])


def _native(arm: str) -> Column[Line]:
    name = f"{PAPER_ARMS[arm]}_native_suffix_sha256"
    return Column(name, "sha256", get=lambda x: x.row.arms[arm].suffix_sha256)


COLUMNS: tuple[Column[Line], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("source_row_sha256", "sha256", get=lambda x: x.source_row_sha256),
    _panel("checkpoint_alias", "text"),
    _panel("selection_index", "int"),
    _panel("selection_basis", "text"),
    _panel("historical_stratum", "text"),
    Column("historical_stratum_reproduced", "bool", get=stratum_reproduced),
    Column("prefix_token_count", "int", get=lambda x: x.row.prefix["prefix_token_count"]),
    Column("prefix_sha256", "sha256", get=lambda x: x.row.prefix["prefix_sha256"]),
    Column("incremental_replica_exact", "bool", get=lambda x: x.row.replicas["left"].passed),
    Column("prefill_replica_exact", "bool", get=lambda x: x.row.replicas["prefill"].passed),
    Column("functional_state_equal", "bool", get=lambda x: x.row.functional_state_equal),
    Column("boundary_argmax_equal", "bool", get=lambda x: x.row.comparison.boundary_argmax_equal),
    Column("all_storage_disjoint", "bool", get=lambda x: x.row.all_storage_disjoint),
    Column("all_48_layer_pairs_transplanted", "bool", get=lambda x: x.row.all_layers_transplanted),
    _native("left"),
    _native("prefill"),
    *_swaps("suffix_sha256", "sha256", lambda x, s: x.row.arms[s.name].suffix_sha256),
    Column("baseline_divergent", "bool", get=lambda x: x.row.diverges),
    *_swaps("recovers_donor", "bool", recovers_donor),
    Column("bidirectional_donor_recovery", "bool", get=bidirectional),
    Column(
        "exact_control_novel_trajectory",
        "bool",
        get=lambda x: not x.row.diverges and not bidirectional(x),
    ),
    Column("integrity_pass", "bool", get=lambda x: x.row.integrity_pass),
    *written(
        Column("precision", "text", get=lambda x: x.row.precision),
        Column("num_layers", "int", get=lambda x: x.row.fields["num_layers"]),
        _panel("panel", "text"),
        Column("prompt_token_count", "int", get=lambda x: x.row.prefix["prompt_token_count"]),
        Column(
            "first_suffix_divergence_index",
            "optional_int",
            get=lambda x: x.row.labels.first_suffix_divergence_index,
        ),
        *_swaps("donor_divergence_index", "optional_int", donor_divergence_index),
        Column(
            "incremental_prefill_cache_exact", "bool", get=lambda x: x.row.comparison.cache_exact
        ),
        Column(
            "incremental_prefill_logits_exact",
            "bool",
            get=lambda x: x.row.comparison.logits["exact"],
        ),
        Column(
            "cache_relative_l2_diff",
            "float",
            get=lambda x: x.row.comparison.cache["relative_l2_diff"],
        ),
        Column("incremental_correct", "bool", get=lambda x: x.row.arms["left"].correct),
        Column("prefill_correct", "bool", get=lambda x: x.row.arms["prefill"].correct),
        *_swaps("correct", "bool", lambda x, s: x.row.arms[s.name].correct),
    ),
)


def transplant_lines(rows: Iterable[Record]) -> Iterator[Line]:
    """The panel's rows, each sourced from the row its prefix was taken from (the
    prefix rows' hashes from the rows' heads, then the lines)."""
    prefixes = prefix_row_hashes(rows)
    for record in rows:
        data = record.data
        if data.get("kind") != "transplant":
            continue
        prefix = prefixes[str(UnitKey.prefix(TRANSPLANT, data["item_id"]))]
        source = data["source"].get("row_sha256") or prefix
        yield Line(PanelRow.from_dict(data, COMPARED), source)


def _check_integrity(ledger: Ledger) -> None:
    for column in INTEGRITY_COLUMNS:
        ledger.require(
            ledger[column], column, "it is false, and every transplant integrity flag must be true"
        )


def _check_derived_flags(ledger: Ledger) -> None:
    """Gate: the summary flags must follow from the two recovery flags."""
    both = np.logical_and(*(ledger[recovers(swap)] for swap in SWAPS))
    ledger.require(
        ledger["bidirectional_donor_recovery"] == both,
        "bidirectional_donor_recovery",
        "it must be true exactly when both recovery flags are true",
    )
    ledger.require(
        ledger["baseline_divergent"] | (ledger["exact_control_novel_trajectory"] == ~both),
        "exact_control_novel_trajectory",
        "on a non-divergent row it must be true exactly when not both recovery flags are true",
    )


CHECKS: tuple[Check, ...] = (_check_integrity, _check_derived_flags)
LINE_CHECKS: tuple[LineCheck, ...] = (
    check_equal_flag(
        "baseline_divergent",
        "incremental_native_suffix_sha256",
        "prefill_native_suffix_sha256",
        equal=False,
    ),
    *(
        check_equal_flag(
            recovers(swap),
            f"{swap.paper}_suffix_sha256",
            f"{PAPER_ARMS[swap.donor]}_native_suffix_sha256",
        )
        for swap in SWAPS
    ),
)
TRANSPLANT_TABLE = Table(
    "kv_transplant_{name}.csv",
    COLUMNS,
    TRANSPLANT,
    transplant_lines,
    checks=CHECKS,
    line_checks=LINE_CHECKS,
)
