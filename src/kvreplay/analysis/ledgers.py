"""Read the paper-named CSV ledgers into typed columns, failing closed.

A claim is only as good as the rows under it, so every gate of the paper's method is
checked before anything is counted: a missing column, a duplicated row id, a
bad boolean, number or hash, or a flag that disagrees with the hashes it
summarises stops the analysis with one sentence naming file, row and field.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from kvreplay.analysis.certificate import tv_distance
from kvreplay.errors import KvreplayError

Kind = Literal[
    "text", "bool", "optional_bool", "sha256", "int", "optional_int", "float", "float_list", "json"
]
Check = Callable[["Ledger"], None]

MATCHED_FILE = "matched_live_prefill.csv"
FIXED_FILE = "fixed_prefix_2x2.csv"
BRIDGE_FILE = "live_teacher_bridge.csv"
HISTORICAL_FILE = "historical_bridge_audit.csv"
STOCK_FILE = "stock_qwen_control.csv"
TRANSPLANT_FILE = re.compile(r"kv_transplant_([A-Za-z0-9_-]+)\.csv")
RESAMPLE_FILE = "resample_live_prefill.csv"
LAYER_DRIFT_COLUMN = "cache_relative_l2_by_layer"

_SHA256 = re.compile(r"[0-9a-f]{64}")


class LedgerError(KvreplayError, ValueError):
    """A ledger that cannot be trusted; the message names file, row id and field."""

    def __init__(
        self, file: str, problem: str, row_id: str | None = None, field: str | None = None
    ):
        row = "header" if row_id == "header" else row_id and f"row {row_id}"
        where = ", ".join(part for part in (file, row, field and f"field {field}") if part)
        super().__init__(f"{where}: {problem}.")
        self.file, self.row_id, self.field, self.problem = file, row_id, field, problem


@dataclass(frozen=True)
class LedgerSpec:
    """The columns one ledger must carry, how rows are keyed, and its consistency gates."""

    columns: Mapping[str, Kind]
    key: tuple[str, ...] = ("row_id",)
    optional: Mapping[str, Kind] = field(default_factory=dict)
    checks: tuple[Check, ...] = ()


@dataclass(frozen=True)
class Ledger:
    """One validated CSV as typed numpy columns (optional ints hold NaN when empty)."""

    file: str
    row_ids: np.ndarray
    columns: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.row_ids.shape[0])

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def __contains__(self, column: object) -> bool:
        return column in self.columns

    def select(self, mask: np.ndarray) -> Ledger:
        """Rows where mask is true, in file order."""
        return Ledger(self.file, self.row_ids[mask], {k: v[mask] for k, v in self.columns.items()})

    def require(self, ok: np.ndarray, column: str, problem: str) -> None:
        """Fail closed on the first row where ok is false."""
        bad = np.flatnonzero(~ok)
        if bad.size:
            raise LedgerError(self.file, problem, str(self.row_ids[bad[0]]), column)


def _parse(kind: Kind, text: str) -> object:
    """One cell to its typed value; raises ValueError with the reason."""
    if kind == "text":
        if not text:
            raise ValueError("is empty")
        return text
    if kind == "optional_bool" and text == "":
        return None
    if kind in ("bool", "optional_bool"):
        if text not in ("true", "false"):
            raise ValueError(f"is {text!r}, not true or false")
        return text == "true"
    if kind == "sha256":
        if not _SHA256.fullmatch(text):
            raise ValueError(f"is {text!r}, not 64 lowercase hex characters")
        return text
    if kind in ("int", "optional_int"):
        if kind == "optional_int" and text == "":
            return math.nan
        if not re.fullmatch(r"-?[0-9]+", text):
            raise ValueError(f"is {text!r}, not an integer")
        return int(text)
    if kind == "float":
        return _finite(text)
    if kind == "json":
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
            raise ValueError(f"is {text[:40]!r}, not JSON") from None
    try:
        values = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        values = None
    if not isinstance(values, list) or not values:
        raise ValueError(f"is {text[:40]!r}, not a JSON array of numbers")
    return np.array([_finite(v) for v in values])


def _finite(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"is {value!r}, not a number") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"is {value!r}, not a finite number")
    return number


def _column_array(kind: Kind, values: list[object]) -> np.ndarray:
    if kind in ("float_list", "json", "optional_bool"):
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array
    dtype = {"bool": bool, "int": np.int64, "optional_int": np.float64, "float": np.float64}
    return np.array(values, dtype=dtype.get(kind, str))


def read_ledger(path: Path, spec: LedgerSpec) -> Ledger:
    """Parse and validate one ledger; any defect raises LedgerError."""
    name = path.name
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            lines = [line for line in csv.reader(handle) if line]
    except UnicodeDecodeError:
        raise LedgerError(name, "the file is not UTF-8 text") from None
    except (OSError, csv.Error) as error:
        raise LedgerError(name, f"the file cannot be read as CSV ({error})") from None
    if not lines:
        raise LedgerError(name, "the file has no header row")
    header, body = lines[0], lines[1:]
    for column in ["row_id", *spec.columns]:
        if column not in header:
            raise LedgerError(name, "the column is missing", "header", column)
    if len(set(header)) != len(header):
        repeated = next(c for c in header if header.count(c) > 1)
        raise LedgerError(name, "the column appears twice", "header", repeated)
    if not body:
        raise LedgerError(name, "the ledger has a header but no rows")
    kinds = {**{k: v for k, v in spec.optional.items() if k in header}, **spec.columns}
    index = {column: header.index(column) for column in ["row_id", *kinds]}
    parsed: dict[str, list[object]] = {column: [] for column in kinds}
    row_ids: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for line_number, cells in enumerate(body, start=2):
        row_id = cells[index["row_id"]] if len(cells) > index["row_id"] else ""
        label = row_id or f"at line {line_number}"
        if len(cells) != len(header):
            problem = f"the row has {len(cells)} fields but the header has {len(header)}"
            raise LedgerError(name, problem, label, "row_id")
        if not row_id:
            raise LedgerError(name, "the row id is empty", label, "row_id")
        for column, kind in kinds.items():
            try:
                parsed[column].append(_parse(kind, cells[index[column]]))
            except ValueError as error:
                raise LedgerError(name, f"the value {error}", row_id, column) from None
        key = tuple(cells[index[c]] for c in spec.key)
        if key in seen:
            raise LedgerError(name, "the row id appears twice", row_id, "row_id")
        seen.add(key)
        row_ids.append(row_id)
    ledger = Ledger(
        name,
        np.array(row_ids, dtype=str),
        {column: _column_array(kind, parsed[column]) for column, kind in kinds.items()},
    )
    for check in spec.checks:
        check(ledger)
    return ledger


def _kinds(kind: Kind, *names: str) -> dict[str, Kind]:
    return dict.fromkeys(names, kind)


def _check_equal_flag(flag: str, left: str, right: str, *, equal: bool = True) -> Check:
    """Gate: a boolean column must say whether two hash columns agree."""
    relation = "are equal" if equal else "differ"

    def check(ledger: Ledger) -> None:
        truth = (ledger[left] == ledger[right]) == equal
        ledger.require(
            ledger[flag] == truth,
            flag,
            f"it must be true exactly when {left} and {right} {relation}",
        )

    return check


def _matrix_spec(left: str, *, drift_norms: bool, served: bool = False) -> LedgerSpec:
    """Schema of a matched or fixed-prefix matrix; only the left arm's name differs. A
    served matrix (a backend without K/V access, named in its ``backend`` column) leaves
    the K/V columns empty and carries the engine's measures instead."""
    columns: dict[str, Kind] = {
        "source_row_sha256": "sha256",
        "precision": "text",
        "prefix_token_count": "int",
        "prefix_sha256": "sha256",
        "first_suffix_divergence_index": "optional_int",
        **_kinds(
            "bool",
            *(
                f"{arm}_replica_{part}_exact"
                for arm in (left, "prefill")
                for part in ("cache", "logits", "suffix")
            ),
            "functional_state_equal",
            "all_storage_disjoint",
            f"{left}_prefill_cache_exact",
            f"{left}_prefill_logits_exact",
            "boundary_argmax_equal",
            "suffix_equal",
            "trace_equal",
            "merge_equal",
            "answer_equal",
            f"{left}_correct",
            "prefill_correct",
            "integrity_pass",
        ),
        **_kinds(
            "float",
            "cache_max_abs_diff",
            "cache_mean_abs_diff",
            "logit_max_abs_diff",
            "logit_mean_abs_diff",
        ),
        **_kinds(
            "sha256",
            *(
                f"{arm}{part}_suffix_sha256"
                for arm in (left, "prefill")
                for part in ("", "_replica")
            ),
        ),
    }
    if drift_norms:
        columns |= _kinds(
            "float",
            "cache_delta_l2_norm",
            "cache_left_l2_norm",
            "cache_right_l2_norm",
            "cache_relative_l2_diff",
        )

    def check_divergence_index(ledger: Ledger) -> None:
        empty = np.isnan(ledger["first_suffix_divergence_index"])
        ledger.require(
            empty == ledger["suffix_equal"],
            "first_suffix_divergence_index",
            "it must be empty exactly when suffix_equal is true",
        )

    def check_layer_drift(ledger: Ledger) -> None:
        if LAYER_DRIFT_COLUMN in ledger:
            layers = np.array([len(values) for values in ledger[LAYER_DRIFT_COLUMN]])
            ledger.require(
                layers == layers[0],
                LAYER_DRIFT_COLUMN,
                f"it must hold {layers[0]} values, one per layer, like the first row",
            )

    if served:
        columns = {k: v for k, v in columns.items() if k not in _kv_columns(left)}
        columns |= {
            "backend": "text",
            **_kinds("int", "live_cached_tokens", "prefill_cached_tokens"),
            **_kinds("optional_bool", *SERVED_CONTROLS),
        }
    return LedgerSpec(
        columns=columns,
        key=("precision", "row_id"),
        optional={} if served else {LAYER_DRIFT_COLUMN: "float_list"},
        checks=(
            _check_equal_flag("suffix_equal", f"{left}_suffix_sha256", "prefill_suffix_sha256"),
            *(
                _check_equal_flag(
                    f"{arm}_replica_suffix_exact",
                    f"{arm}_suffix_sha256",
                    f"{arm}_replica_suffix_sha256",
                )
                for arm in (left, "prefill")
            ),
            check_divergence_index,
            check_layer_drift,
            _check_cross_precision_pairing,
        ),
    )


# A served row's controls and what each compares: empty where the plan or the item set
# leaves the arm out.
SERVED_CONTROLS = {
    "uninterrupted_equal_live": "uninterrupted request vs cache hit",
    "uninterrupted_equal_prefill": "uninterrupted request vs cache miss",
    "batched_equal_live": "hit with companions vs hit alone",
}


def _kv_columns(left: str) -> frozenset[str]:
    """Matrix columns only a backend with K/V access can fill."""
    return frozenset(
        {f"{arm}_replica_cache_exact" for arm in (left, "prefill")}
        | {"functional_state_equal", "all_storage_disjoint", f"{left}_prefill_cache_exact"}
        | {"cache_max_abs_diff", "cache_mean_abs_diff", "logit_max_abs_diff", "logit_mean_abs_diff"}
    )


def _check_cross_precision_pairing(ledger: Ledger) -> None:
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


def _check_bridge_lengths(ledger: Ledger) -> None:
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


HISTORICAL_LEAF_COLUMNS = (
    "cache_common_scalar_leaves_per_section",
    "logit_common_scalar_leaves_per_section",
)
HISTORICAL_FLAG_COLUMNS = (
    "prefix_commitment_equal",
    "live_incremental_suffix_equal",
    "live_replica_suffix_equal",
    "prefill_suffix_equal",
    "prefill_replica_suffix_equal",
    "comparison_objects_equal",
    *(
        f"{part}_{pair}_fingerprint_equal"
        for part in ("cache", "logits")
        for pair in ("live_replica", "live_prefill", "prefill_replica")
    ),
    "audit_pass",
)


def _check_constant_leaves(ledger: Ledger) -> None:
    """Gate: leaf counts describe the schema, so a change across rows is a schema error."""
    for column in HISTORICAL_LEAF_COLUMNS:
        ledger.require(
            ledger[column] == ledger[column][0], column, "it must be the same on every row"
        )


TRANSPLANT_INTEGRITY_COLUMNS = (
    "incremental_replica_exact",
    "prefill_replica_exact",
    "functional_state_equal",
    "all_storage_disjoint",
    "all_48_layer_pairs_transplanted",
    "integrity_pass",
)
TRANSPLANT_RECOVERY = {
    "incremental_cache_into_prefill_recovers_donor": (
        "incremental_cache_into_prefill_suffix_sha256",
        "incremental_native_suffix_sha256",
    ),
    "prefill_cache_into_incremental_recovers_donor": (
        "prefill_cache_into_incremental_suffix_sha256",
        "prefill_native_suffix_sha256",
    ),
}


def _check_transplant_integrity(ledger: Ledger) -> None:
    for column in TRANSPLANT_INTEGRITY_COLUMNS:
        ledger.require(
            ledger[column], column, "it is false, and every transplant integrity flag must be true"
        )


def _check_transplant_derived_flags(ledger: Ledger) -> None:
    """Gate: the summary flags must follow from the two recovery flags."""
    both = np.logical_and(*(ledger[flag] for flag in TRANSPLANT_RECOVERY))
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


def _check_resample_rows(ledger: Ledger) -> None:
    """Gates: every per-seed list holds one entry per sample, and each summary column
    (changed seeds, accuracy, answer distribution, TV) follows from the lists."""
    ledger.require(ledger["integrity_pass"], "integrity_pass", "a resample row must pass")
    ledger.require(
        ledger["margin"] == ledger["margin"][0], "margin", "it must be the same on every row"
    )
    samples = ledger["samples"]
    for column in RESAMPLE_SEED_LISTS:
        lengths = np.array([len(v) if isinstance(v, list) else -1 for v in ledger[column]])
        ledger.require(lengths == samples, column, "it must list one entry per sample")
    changed = np.array([sum(i is not None for i in v) for v in ledger["first_divergence_indices"]])
    ledger.require(
        changed == ledger["seeds_changed"], "seeds_changed", "it must count the non-null indices"
    )
    for arm in ("live", "prefill"):
        accuracy = np.array([sum(v) / len(v) for v in ledger[f"{arm}_correct"]])
        ledger.require(
            np.isclose(accuracy, ledger[f"{arm}_accuracy"]),
            f"{arm}_accuracy",
            f"it must be the share of true in {arm}_correct",
        )
        counted = np.array(
            [
                Counter(answers) == {a: n for a, n in pairs}
                for answers, pairs in zip(
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


RESAMPLE_SEED_LISTS = (
    "seeds",
    "first_divergence_indices",
    "live_answers",
    "live_correct",
    "prefill_answers",
    "prefill_correct",
)
RESAMPLE_SPEC = LedgerSpec(
    columns={
        **_kinds("sha256", "source_row_sha256", "prefix_sha256"),
        "precision": "text",
        **_kinds("int", "prefix_token_count", "samples", "replica_samples", "seeds_changed"),
        **_kinds("float", "temperature", "top_p", "margin", "share_changed", "tv_distance"),
        **_kinds("float", "live_accuracy", "prefill_accuracy"),
        **_kinds("json", *RESAMPLE_SEED_LISTS),
        **_kinds("json", "live_answer_distribution", "prefill_answer_distribution"),
        **_kinds("bool", "live_replica_exact", "prefill_replica_exact", "integrity_pass"),
    },
    key=("precision", "row_id"),
    checks=(_check_resample_rows,),
)

SPECS: dict[str, LedgerSpec] = {
    RESAMPLE_FILE: RESAMPLE_SPEC,
    MATCHED_FILE: _matrix_spec("live", drift_norms=False),
    FIXED_FILE: _matrix_spec("incremental", drift_norms=True),
    BRIDGE_FILE: LedgerSpec(
        columns={
            **_kinds(
                "sha256", "source_row_sha256", "new_prefix_sha256", "historical_prefix_sha256"
            ),
            **_kinds("sha256", "live_suffix_sha256", "teacher_suffix_sha256"),
            **_kinds(
                "int",
                "selection_index",
                "new_prefix_token_count",
                "historical_prefix_token_count",
                "boundary_cache_sequence_len",
                "post_decode_cache_sequence_len",
            ),
            **_kinds(
                "bool",
                "live_matches_historical_prefix",
                "live_clone_cache_exact",
                "live_clone_logits_exact",
                "teacher_clone_cache_exact",
                "teacher_clone_logits_exact",
                "functional_state_equal",
                "all_storage_disjoint",
                "live_teacher_cache_exact",
                "live_teacher_logits_exact",
                "boundary_argmax_equal",
                "live_teacher_suffix_exact",
                "all_48_layers_exact",
                "integrity_pass",
            ),
        },
        checks=(
            _check_bridge_lengths,
            _check_equal_flag(
                "live_teacher_suffix_exact", "live_suffix_sha256", "teacher_suffix_sha256"
            ),
        ),
    ),
    HISTORICAL_FILE: LedgerSpec(
        columns={
            **_kinds("sha256", "source_live_row_sha256", "source_incremental_row_sha256"),
            **_kinds("bool", *HISTORICAL_FLAG_COLUMNS),
            **_kinds("int", *HISTORICAL_LEAF_COLUMNS),
        },
        checks=(_check_constant_leaves,),
    ),
    STOCK_FILE: LedgerSpec(
        columns={
            "source_row_sha256": "sha256",
            **_kinds(
                "int",
                "selection_index",
                "input_token_count",
                "singleton_output_token_count",
                "paired_output_token_count",
            ),
            **_kinds(
                "bool",
                "pair_replica_tokens_exact",
                "pair_replica_logprobs_exact",
                "singleton_pair_tokens_exact",
                "singleton_pair_logprobs_exact",
            ),
            **_kinds(
                "optional_int", "first_token_divergence_index", "first_logprob_divergence_index"
            ),
            "max_abs_aligned_selected_token_logprob_difference": "float",
        },
    ),
}
TRANSPLANT_SPEC = LedgerSpec(
    columns={
        **_kinds("sha256", "source_row_sha256", "prefix_sha256"),
        **_kinds("text", "checkpoint_alias", "selection_basis", "historical_stratum"),
        **_kinds("int", "selection_index", "prefix_token_count"),
        **_kinds(
            "sha256",
            "incremental_native_suffix_sha256",
            "prefill_native_suffix_sha256",
            *(transplanted for transplanted, _ in TRANSPLANT_RECOVERY.values()),
        ),
        **_kinds(
            "bool",
            "historical_stratum_reproduced",
            "boundary_argmax_equal",
            "baseline_divergent",
            "bidirectional_donor_recovery",
            "exact_control_novel_trajectory",
            *TRANSPLANT_INTEGRITY_COLUMNS,
            *TRANSPLANT_RECOVERY,
        ),
    },
    checks=(
        _check_transplant_integrity,
        _check_equal_flag(
            "baseline_divergent",
            "incremental_native_suffix_sha256",
            "prefill_native_suffix_sha256",
            equal=False,
        ),
        *(_check_equal_flag(flag, *hashes) for flag, hashes in TRANSPLANT_RECOVERY.items()),
        _check_transplant_derived_flags,
    ),
)


SERVED_MATCHED_SPEC = _matrix_spec("live", drift_norms=False, served=True)


def spec_for(file: str | Path) -> LedgerSpec | None:
    """The spec of a known ledger file (or file name), or None for any other file; a
    matched ledger file with a ``backend`` column is a served one."""
    path = Path(file)
    if TRANSPLANT_FILE.fullmatch(path.name):
        return TRANSPLANT_SPEC
    if path.name == MATCHED_FILE and path.is_file() and "backend" in _header(path):
        return SERVED_MATCHED_SPEC
    return SPECS.get(path.name)


def _header(path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return next(csv.reader(handle), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return []  # read_ledger names the problem


def load_ledger_dir(folder: Path) -> dict[str, Ledger]:
    """Every known ledger in a folder, validated, keyed by file name in sorted order."""
    if not folder.is_dir():
        raise LedgerError(str(folder), "the folder does not exist or is not a directory")
    ledgers = {
        path.name: read_ledger(path, spec)
        for path in sorted(folder.iterdir())
        if path.is_file() and (spec := spec_for(path)) is not None
    }
    if not ledgers:
        raise LedgerError(str(folder), "the folder holds none of the known ledger CSVs")
    if (folder / "manifest.json").is_file() and (folder / "rows.jsonl").is_file():
        _check_against_run(folder)
    return ledgers


def _check_against_run(folder: Path) -> None:
    """A kvreplay run's CSVs are derived from its rows.jsonl, the source of truth: one
    cut at a row boundary (or edited) would otherwise be analysed as a smaller (or
    different) run."""
    from kvreplay.derived import check_csvs
    from kvreplay.ledger import RunLedger, parse_rows

    ledger = RunLedger.open_existing(folder)
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    problems += check_csvs(ledger, records, present_only=True)
    if problems:
        raise LedgerError(
            str(folder),
            f"the run's CSVs do not match its rows.jsonl ({problems[0]}); "
            "rerun the experiment to rewrite them, or run kvreplay audit",
        )
