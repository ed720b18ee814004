"""The ``resample`` CSV (``resample_live_prefill.csv``): per item and precision, the live
and prefill states each continued once per seed; every per-seed list holds one entry per
sample, and each summary column follows from the lists. A served row (a backend without
K/V access) leaves the K/V columns empty and names its ``backend``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kvreplay.core.canonical import canonical
from kvreplay.harness.columns import Column, Kind, Line, kv, optional, reached_lines, written
from kvreplay.harness.rows import ArmResult, PairLabels
from kvreplay.harness.table import Ledger, Table, check_same
from kvreplay.measure.certificate import tv_distance

RESAMPLE = "resample"
COMPARED = ("live", "prefill")
SEED_LISTS = (
    "seeds",
    "first_divergence_indices",
    "live_answers",
    "live_correct",
    "prefill_answers",
    "prefill_correct",
)


def answers(samples: list[ArmResult]) -> list[str | None]:
    """Each seed's extracted answer; None where no answer parsed."""
    return [s.answer if s.answer_parsed else None for s in samples]


def distribution(values: list[str | None]) -> list[list[Any]]:
    """Answer counts as sorted ``[answer, count]`` pairs (unparsed first, as null)."""
    counts = Counter(values)
    return [[a, counts[a]] for a in sorted(counts, key=lambda a: (a is not None, a or ""))]


def _json(value: Any) -> str:
    return canonical(value).decode()


def _side(arm: str) -> Callable[[Line], list[ArmResult]]:
    return lambda x: x.row.samples[arm]


def _divergences(line: Line) -> list[int | None]:
    return [PairLabels.of(a, b).first_suffix_divergence_index for a, b in line.row.pairs]


def _changed(line: Line) -> int:
    return sum(a.suffix_sha256 != b.suffix_sha256 for a, b in line.row.pairs)


def _sampling(field: str, kind: Kind) -> Column[Line]:
    return Column(field, kind, get=lambda x: x.row.fields["resample"][field])


def _arm_columns(arm: str) -> list[Column[Line]]:
    samples = _side(arm)
    return [
        Column(
            f"{arm}_accuracy",
            "float",
            get=lambda x: sum(s.correct for s in samples(x)) / len(samples(x)),
        ),
        Column(f"{arm}_answers", "json", get=lambda x: _json(answers(samples(x)))),
        Column(f"{arm}_correct", "json", get=lambda x: _json([s.correct for s in samples(x)])),
        Column(
            f"{arm}_answer_distribution",
            "json",
            get=lambda x: _json(distribution(answers(samples(x)))),
        ),
        Column(f"{arm}_replica_exact", "bool", get=lambda x: x.row.replicas[arm].passed),
    ]


def _logits_exact(line: Line) -> bool:
    """Boundary logits bit-equal; on a served row, the first seed's first-step top
    logprobs (raw logits, before any sampling)."""
    if line.row.comparison is not None:
        return line.row.comparison.logits["exact"]
    live, prefill = (line.row.samples[arm][0] for arm in COMPARED)
    return live.logits_fingerprint == prefill.logits_fingerprint


def _tv(line: Line) -> float:
    live, prefill = (answers(line.row.samples[arm]) for arm in COMPARED)
    return round(tv_distance(live, prefill), 9)


COLUMNS: tuple[Column[Line], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("source_row_sha256", "sha256", get=lambda x: x.source_row_sha256),
    Column("precision", "text", get=lambda x: x.row.precision),
    Column("prefix_token_count", "int", get=lambda x: x.row.prefix["prefix_token_count"]),
    Column("prefix_sha256", "sha256", get=lambda x: x.row.prefix["prefix_sha256"]),
    _sampling("temperature", "float"),
    _sampling("top_p", "float"),
    _sampling("margin", "float"),
    Column("samples", "int", get=lambda x: len(x.row.pairs)),
    Column("seeds", "json", get=lambda x: _json(x.row.fields["resample"]["seeds"])),
    _sampling("replica_samples", "int"),
    *written(
        Column("live_prefill_cache_exact", "bool", get=kv(lambda c: c.cache_exact)),
        Column("live_prefill_logits_exact", "bool", get=_logits_exact),
        Column("boundary_argmax_equal", "bool", get=kv(lambda c: c.boundary_argmax_equal)),
    ),
    Column("seeds_changed", "int", get=_changed),
    Column("share_changed", "float", get=lambda x: round(_changed(x) / len(x.row.pairs), 9)),
    Column("first_divergence_indices", "json", get=lambda x: _json(_divergences(x))),
    Column("tv_distance", "float", get=_tv),
    *_arm_columns("live"),
    *_arm_columns("prefill"),
    *written(
        Column("functional_state_equal", "bool", get=lambda x: x.row.functional_state_equal),
        Column("all_storage_disjoint", "bool", get=lambda x: x.row.all_storage_disjoint),
    ),
    Column("integrity_pass", "bool", get=lambda x: x.row.integrity_pass),
    *written(Column("prompt_token_count", "int", get=lambda x: x.row.prefix["prompt_token_count"])),
)
# Columns a served row leaves empty.
KV_ONLY = (
    "live_prefill_cache_exact",
    "boundary_argmax_equal",
    "functional_state_equal",
    "all_storage_disjoint",
)


def _check_rows(ledger: Ledger) -> None:
    """Gates: every per-seed list holds one entry per sample, and each summary column
    (changed seeds, accuracy, answer distribution, TV) follows from the lists."""
    ledger.require(ledger["integrity_pass"], "integrity_pass", "a resample row must pass")
    check_same("margin")(ledger)
    samples = ledger["samples"]
    for column in SEED_LISTS:
        lengths = np.array([len(v) if isinstance(v, list) else -1 for v in ledger[column]])
        ledger.require(lengths == samples, column, "it must list one entry per sample")
    changed = np.array([sum(i is not None for i in v) for v in ledger["first_divergence_indices"]])
    ledger.require(
        changed == ledger["seeds_changed"], "seeds_changed", "it must count the non-null indices"
    )
    for arm in COMPARED:
        accuracy = np.array([sum(v) / len(v) for v in ledger[f"{arm}_correct"]])
        ledger.require(
            np.isclose(accuracy, ledger[f"{arm}_accuracy"]),
            f"{arm}_accuracy",
            f"it must be the share of true in {arm}_correct",
        )
        counted = np.array(
            [
                Counter(values) == {a: n for a, n in pairs}
                for values, pairs in zip(
                    ledger[f"{arm}_answers"], ledger[f"{arm}_answer_distribution"], strict=True
                )
            ]
        )
        ledger.require(
            counted, f"{arm}_answer_distribution", f"it must count the answers of {arm}_answers"
        )
    tv = np.array(
        [
            tv_distance(a, b)
            for a, b in zip(ledger["live_answers"], ledger["prefill_answers"], strict=True)
        ]
    )
    ledger.require(
        np.isclose(tv, ledger["tv_distance"]), "tv_distance", "it must follow from the answers"
    )


RESAMPLE_TABLE = Table(
    "resample_live_prefill.csv",
    COLUMNS,
    RESAMPLE,
    reached_lines(COMPARED),
    ("precision", "row_id"),
    (_check_rows,),
)
SERVED_RESAMPLE_TABLE = replace(
    RESAMPLE_TABLE,
    columns=(
        *(replace(c, kind=optional(c.kind)) if c.name in KV_ONLY else c for c in COLUMNS),
        *written(Column("backend", "text", get=lambda x: x.row.fields["backend"])),
    ),
    marker="backend",
)
