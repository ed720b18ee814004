"""The run folder's format, below every layer that reads or writes one: the manifest and the
hash-chained rows (``run``), a row and its strict reader (``records``), rows read one at a
time (``rows``), atomic writes (``files``), the derived CSVs' bytes (``csvfile``) and the
one-writer lock (``writer``). Nothing here knows an experiment, a backend or a model."""

from kvreplay.ledger.csvfile import (
    csv_cell,
    csv_dict_reader,
    csv_reader,
    render_csv,
    render_csv_lines,
)
from kvreplay.ledger.files import disk_error, write_atomic, write_text_atomic
from kvreplay.ledger.records import GENESIS, Record, TamperedLedger, parse_rows, read_rows
from kvreplay.ledger.rows import RowAt, RowHead, RowsByKey, RunRows, heads, rows_of
from kvreplay.ledger.run import (
    CONTRACT_SCHEME,
    ENGINE_LOG,
    ENGINE_NOTE,
    EXPERIMENT_ENTRY,
    INFORMATIONAL,
    ITEMS,
    MANIFEST,
    MANIFEST_TYPES,
    MAX_MANIFEST_BYTES,
    ROWS,
    RUN_FORMAT,
    SNAPSHOTS_SAVED,
    STOPPED,
    RunLedger,
    contract_scheme,
    diff_fields,
    manifest_bytes,
)
from kvreplay.ledger.writer import RunLock

__all__ = [
    "CONTRACT_SCHEME",
    "ENGINE_NOTE",
    "ENGINE_LOG",
    "EXPERIMENT_ENTRY",
    "GENESIS",
    "INFORMATIONAL",
    "ITEMS",
    "MANIFEST",
    "MANIFEST_TYPES",
    "MAX_MANIFEST_BYTES",
    "ROWS",
    "RUN_FORMAT",
    "SNAPSHOTS_SAVED",
    "STOPPED",
    "Record",
    "RowAt",
    "RowHead",
    "RowsByKey",
    "RunLedger",
    "RunLock",
    "RunRows",
    "TamperedLedger",
    "contract_scheme",
    "csv_cell",
    "csv_dict_reader",
    "csv_reader",
    "diff_fields",
    "manifest_bytes",
    "disk_error",
    "heads",
    "parse_rows",
    "read_rows",
    "render_csv",
    "render_csv_lines",
    "rows_of",
    "write_atomic",
    "write_text_atomic",
]
