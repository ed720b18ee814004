"""Every fail-closed gate, each on a deliberately broken copy of a ledger.

Each gate runs twice: on a small synthetic ledger built from its table (so the gates
are tested without the paper's data) and on a copy of the paper's published ledger
(skipped when ../shared/paper-release is absent). The localize ledger's gates run on a
copy of the committed localize run's CSV.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import Rows, synthetic_ledger, token_hash, write_ledger

from kvreplay.analysis.ledgers import load_ledger_dir
from kvreplay.experiments.bridge.table import BRIDGE_TABLE
from kvreplay.experiments.matrix.table import FIXED_PREFIX_TABLE, LAYER_DRIFT, MATCHED_TABLE
from kvreplay.experiments.paper.table import HISTORICAL_TABLE, STOCK_TABLE
from kvreplay.harness.table import LedgerError
from kvreplay.report.commands import analyze

PAPER_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release" / "data"
MATCHED_FILE, FIXED_FILE, BRIDGE_FILE = (
    MATCHED_TABLE.file,
    FIXED_PREFIX_TABLE.file,
    BRIDGE_TABLE.file,
)
HISTORICAL_FILE, STOCK_FILE = HISTORICAL_TABLE.file, STOCK_TABLE.file
TRANSPLANT_FILE = "kv_transplant_primary.csv"


def paper_ledger(file_name: str) -> tuple[list[str], Rows]:
    path = PAPER_DATA / file_name
    if not path.is_file():
        pytest.skip(f"the paper's ledgers are not at {PAPER_DATA} (clone with shared/ beside it)")
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def first(rows: Rows, **conditions: str) -> dict[str, str]:
    """The first row whose columns hold the given values."""
    return next(row for row in rows if all(row[k] == v for k, v in conditions.items()))


def flip(row: dict[str, str], column: str) -> str:
    row[column] = "false" if row[column] == "true" else "true"
    return row["row_id"]


Mutation = Callable[[list[str], Rows], str]


@dataclass(frozen=True)
class Gate:
    file: str
    field: str
    mutate: Mutation  # breaks the ledger in place, returns the row id the error must name


def _missing_column(header: list[str], rows: Rows) -> str:
    header.remove("suffix_equal")
    return "header"


def _duplicate_column(header: list[str], rows: Rows) -> str:
    header.append("prefix_sha256")
    return "header"


def _duplicate_matrix_row(header: list[str], rows: Rows) -> str:
    rows[1]["row_id"] = rows[0]["row_id"]
    return rows[0]["row_id"]


def _duplicate_row(header: list[str], rows: Rows) -> str:
    rows[-1]["row_id"] = rows[0]["row_id"]
    return rows[0]["row_id"]


def _set(column: str, value: str | Callable[[dict[str, str]], str], **where: str) -> Mutation:
    def mutate(header: list[str], rows: Rows) -> str:
        row = first(rows, **where)
        row[column] = value(row) if callable(value) else value
        return row["row_id"]

    return mutate


def _flip(column: str, **where: str) -> Mutation:
    return lambda header, rows: flip(first(rows, **where), column)


def _swap_fp32_order(header: list[str], rows: Rows) -> str:
    fp32 = [i for i, row in enumerate(rows) if row["precision"] == "fp32"]
    rows[fp32[0]], rows[fp32[1]] = rows[fp32[1]], rows[fp32[0]]
    return rows[fp32[0]]["row_id"]


def _layer_drift(broken: str) -> Mutation:
    def mutate(header: list[str], rows: Rows) -> str:
        header.append(LAYER_DRIFT)
        for row in rows:
            row[LAYER_DRIFT] = "[0.1, 0.2, 0.3]"
        rows[-1][LAYER_DRIFT] = broken
        return rows[-1]["row_id"]

    return mutate


GATES = {
    "missing column": Gate(MATCHED_FILE, "suffix_equal", _missing_column),
    "column twice": Gate(MATCHED_FILE, "prefix_sha256", _duplicate_column),
    "duplicate row id in a matrix precision": Gate(MATCHED_FILE, "row_id", _duplicate_matrix_row),
    "duplicate row id": Gate(TRANSPLANT_FILE, "row_id", _duplicate_row),
    "empty row id": Gate(BRIDGE_FILE, "row_id", _set("row_id", "")),
    "bad boolean": Gate(MATCHED_FILE, "answer_equal", _set("answer_equal", "True")),
    "malformed hash": Gate(
        FIXED_FILE,
        "prefill_suffix_sha256",
        _set("prefill_suffix_sha256", lambda r: r["prefill_suffix_sha256"].upper()),
    ),
    "short hash": Gate(STOCK_FILE, "source_row_sha256", _set("source_row_sha256", "abc123")),
    "bad integer": Gate(FIXED_FILE, "prefix_token_count", _set("prefix_token_count", "12.5")),
    "non-finite float": Gate(MATCHED_FILE, "cache_max_abs_diff", _set("cache_max_abs_diff", "nan")),
    "bad optional integer": Gate(
        MATCHED_FILE,
        "first_suffix_divergence_index",
        _set("first_suffix_divergence_index", "soon", suffix_equal="false"),
    ),
    "suffix flag vs hashes": Gate(
        MATCHED_FILE, "suffix_equal", _flip("suffix_equal", suffix_equal="false")
    ),
    "replica suffix flag vs hashes": Gate(
        FIXED_FILE,
        "incremental_replica_suffix_exact",
        _set("incremental_replica_suffix_sha256", token_hash([4, 4])),
    ),
    "divergence index on an equal suffix": Gate(
        MATCHED_FILE,
        "first_suffix_divergence_index",
        _set("first_suffix_divergence_index", "5", suffix_equal="true"),
    ),
    "precisions not paired by order": Gate(FIXED_FILE, "row_id", _swap_fp32_order),
    "layer drift length": Gate(MATCHED_FILE, LAYER_DRIFT, _layer_drift("[0.1, 0.2]")),
    "layer drift not JSON": Gate(FIXED_FILE, LAYER_DRIFT, _layer_drift("0.1;0.2;0.3")),
    "bridge boundary length": Gate(
        BRIDGE_FILE,
        "boundary_cache_sequence_len",
        _set("boundary_cache_sequence_len", lambda r: str(int(r["new_prefix_token_count"]) + 1)),
    ),
    "bridge post-decode length": Gate(
        BRIDGE_FILE,
        "post_decode_cache_sequence_len",
        _set(
            "post_decode_cache_sequence_len",
            lambda r: str(int(r["boundary_cache_sequence_len"]) - 1),
        ),
    ),
    "bridge suffix flag vs hashes": Gate(
        BRIDGE_FILE, "live_teacher_suffix_exact", _flip("live_teacher_suffix_exact")
    ),
    "historical leaf count changes": Gate(
        HISTORICAL_FILE,
        "cache_common_scalar_leaves_per_section",
        lambda header, rows: _set("cache_common_scalar_leaves_per_section", "1157")(
            header, rows[1:]
        ),
    ),
    "transplant integrity flag": Gate(
        TRANSPLANT_FILE, "all_storage_disjoint", _set("all_storage_disjoint", "false")
    ),
    "baseline_divergent vs hashes": Gate(
        TRANSPLANT_FILE,
        "baseline_divergent",
        _flip("baseline_divergent", baseline_divergent="true"),
    ),
    "recovery flag vs hashes (replay cache into prefill)": Gate(
        TRANSPLANT_FILE,
        "incremental_cache_into_prefill_recovers_donor",
        _flip("incremental_cache_into_prefill_recovers_donor", baseline_divergent="true"),
    ),
    "recovery flag vs hashes (prefill cache into replay)": Gate(
        TRANSPLANT_FILE,
        "prefill_cache_into_incremental_recovers_donor",
        _set(
            "prefill_cache_into_incremental_suffix_sha256",
            token_hash([5]),
            baseline_divergent="false",
        ),
    ),
    "bidirectional recovery vs both flags": Gate(
        TRANSPLANT_FILE, "bidirectional_donor_recovery", _flip("bidirectional_donor_recovery")
    ),
    "exact control novel trajectory": Gate(
        TRANSPLANT_FILE,
        "exact_control_novel_trajectory",
        _flip("exact_control_novel_trajectory", baseline_divergent="false"),
    ),
}


@pytest.fixture(params=["synthetic", "paper"])
def source(request: pytest.FixtureRequest) -> Callable[[str], tuple[list[str], Rows]]:
    return synthetic_ledger if request.param == "synthetic" else paper_ledger


@pytest.mark.parametrize(
    "file_name",
    [MATCHED_FILE, FIXED_FILE, BRIDGE_FILE, HISTORICAL_FILE, STOCK_FILE, TRANSPLANT_FILE],
)
def test_unbroken_ledger_passes(tmp_path: Path, source, file_name: str) -> None:
    """The baseline every gate test breaks must itself be valid."""
    write_ledger(tmp_path, file_name, *source(file_name))
    assert list(load_ledger_dir(tmp_path).ledgers) == [file_name]


@pytest.mark.parametrize("gate", GATES.values(), ids=GATES.keys())
def test_gate_fails_closed(tmp_path: Path, source, gate: Gate) -> None:
    header, rows = source(gate.file)
    row_id = gate.mutate(header, rows)
    write_ledger(tmp_path, gate.file, header, rows)
    with pytest.raises(LedgerError) as caught:
        load_ledger_dir(tmp_path)
    error = caught.value
    assert (error.file, error.field) == (gate.file, gate.field)
    assert error.row_id == (row_id or error.row_id)  # an empty id is named by its line
    message = str(error)
    assert message.startswith(gate.file) and message.endswith(".")
    assert f"field {gate.field}" in message
    assert ("header" if row_id == "header" else f"row {error.row_id}") in message
    assert "\n" not in message


def test_ragged_row_fails_closed(tmp_path: Path, source) -> None:
    path = write_ledger(tmp_path, STOCK_FILE, *source(STOCK_FILE))
    with path.open("a", encoding="utf-8") as handle:
        handle.write("r9999,true\n")
    with pytest.raises(LedgerError, match=r"row r9999, field row_id: the row has 2 fields"):
        load_ledger_dir(tmp_path)


def test_header_only_ledger_fails_closed(tmp_path: Path, source) -> None:
    header, _ = source(BRIDGE_FILE)
    write_ledger(tmp_path, BRIDGE_FILE, header, [])
    with pytest.raises(LedgerError, match="has a header but no rows"):
        load_ledger_dir(tmp_path)


def test_folder_without_ledgers_fails_closed(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a ledger")
    with pytest.raises(LedgerError, match="holds none of the known ledger CSVs"):
        load_ledger_dir(tmp_path)
    with pytest.raises(LedgerError, match="does not exist"):
        load_ledger_dir(tmp_path / "missing")


def test_cli_prints_one_sentence_and_exits_2(tmp_path: Path, source) -> None:
    header, rows = source(MATCHED_FILE)
    rows[0]["integrity_pass"] = "yes"
    write_ledger(tmp_path, MATCHED_FILE, header, rows)
    result = CliRunner().invoke(analyze, [str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith("kvreplay: error: matched_live_prefill.csv, row r0000")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "claims.json").exists()


def test_cli_bad_folder_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(analyze, [str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert result.stderr.startswith("kvreplay: error: ") and "Traceback" not in result.output


LOCALIZE_CSV = Path(__file__).resolve().parents[2] / "results" / "localize-smollm2" / "localize.csv"


def _localize_ledger() -> tuple[list[str], Rows]:
    with LOCALIZE_CSV.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


LOCALIZE_GATES = {
    "a recovering probe with a divergence index": (
        "first_divergence_index",
        _flip("recovers_donor", recovers_donor="false"),
    ),
    "a leaving probe with the donor's hash": (
        "suffix_sha256",
        _set("suffix_sha256", token_hash([1]), recovers_donor="false"),
    ),
    "two precisions in one run": ("precision", _set("precision", "fp32", sweep="suffix")),
}


@pytest.mark.parametrize(("field", "mutate"), LOCALIZE_GATES.values(), ids=LOCALIZE_GATES.keys())
def test_localize_gate_fails_closed(tmp_path: Path, field: str, mutate: Mutation) -> None:
    header, rows = _localize_ledger()
    write_ledger(tmp_path, LOCALIZE_CSV.name, header, rows)
    assert list(load_ledger_dir(tmp_path).ledgers) == [LOCALIZE_CSV.name]
    row_id = mutate(header, rows)
    write_ledger(tmp_path, LOCALIZE_CSV.name, header, rows)
    with pytest.raises(LedgerError) as caught:
        load_ledger_dir(tmp_path)
    assert (caught.value.file, caught.value.row_id, caught.value.field) == (
        LOCALIZE_CSV.name,
        row_id,
        field,
    )
