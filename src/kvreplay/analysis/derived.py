"""The CSVs a run derives from its ``rows.jsonl`` (the source of truth), and the check that
they still do: ``kvreplay audit`` runs it, and so does ``kvreplay analyze`` on a run
folder, so that a CSV cut or edited by hand is never analysed as the run's."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvreplay.core.paths import open_regular, read_regular
from kvreplay.experiments.registry import recorded_table
from kvreplay.ledger import Record, RunLedger, csv_dict_reader, rows_of


def _same_bytes(path: Path, lines: Iterator[str]) -> bool:
    """Whether a file holds exactly these lines, compared by digest so that neither the
    file nor the derived text is held whole."""
    derived, size = hashlib.sha256(), 0
    for line in lines:
        data = line.encode("utf-8")
        derived.update(data)
        size += len(data)
    with open_regular(path) as handle:
        if os.fstat(handle.fileno()).st_size != size:
            return False  # not read at all: a file of another size holds other bytes
        return hashlib.file_digest(handle, "sha256").digest() == derived.digest()


def _read_csv(path: Path, derived: int) -> tuple[str, str | None]:
    """A derived CSV's text to compare field by field, read only when it is a regular
    file of about the size rows.jsonl derives, or what is wrong with it: (text, None) or
    ("", problem). Bytes, not read_text: that would read CRLF endings as the run's LF."""
    if path.is_symlink() or not path.is_file():
        return "", "not a regular file (a run writes its CSV as one)"
    size = path.stat().st_size
    if size > 2 * derived + 2**20:
        return "", f"{size} bytes, where rows.jsonl derives {derived}"
    try:
        return read_regular(path).decode("utf-8"), None
    except OSError as exc:
        return "", f"cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return "", "not UTF-8 text"


def check_csvs(
    ledger: RunLedger, records: Iterable[Record], present_only: bool = False
) -> list[str]:
    """Each experiment's CSV must equal the one derived from rows.jsonl, byte for byte;
    ``present_only`` skips experiments whose CSV is not written yet (a run in progress).
    ``records`` may be a run's rows read afresh (:class:`~kvreplay.ledger.RunRows`): a
    CSV that matches is checked a line at a time, one that does not is then compared
    field by field."""
    problems = []
    for name, entry in ledger.manifest.get("experiments", {}).items():
        table = recorded_table(name, ledger.manifest)
        if table is None:
            problems.append(f"experiment {name}: unknown to this kvreplay version")
            continue
        config = entry["config"]
        path = ledger.run_dir / table.csv_name(config)
        if present_only and not path.exists():
            continue
        rows = rows_of(records, name)
        regular = path.is_file() and not path.is_symlink()
        try:
            if regular and _same_bytes(path, table.csv_lines(rows, config)):
                continue
            expected = table.csv(rows, config)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            problems.append(f"{path.name}: cannot be derived from rows.jsonl ({exc!r})")
            continue  # hand-edited row data
        if not path.exists() and not path.is_symlink():
            problems.append(f"{path.name}: missing although {name} has rows")
            continue
        problems += _differences(path, table.header(config), expected)
    return problems


def _differences(path: Path, columns: list[str], expected: str) -> list[str]:
    """How a CSV departs from the one derived from rows.jsonl: its rows and fields where
    they differ, else its bytes (line endings, quoting, columns)."""
    actual, unreadable = _read_csv(path, len(expected.encode("utf-8")))
    if unreadable is not None:
        return [f"{path.name}: {unreadable}"]
    if actual == expected:
        return []
    problems = []
    want = list(csv_dict_reader(io.StringIO(expected)))
    try:
        have = list(csv_dict_reader(io.StringIO(actual, newline="")))
    except csv.Error as exc:
        return [f"{path.name}: does not read as a CSV ({exc})"]
    if len(want) != len(have):
        problems.append(f"{path.name}: {len(have)} rows, rows.jsonl derives {len(want)}")
    for a, b in zip(want, have, strict=False):
        for column in columns:
            if a.get(column) != b.get(column):
                problems.append(
                    f"{path.name} row {a.get('row_id')} ({a.get('precision', '')})"
                    f": field {column} is {b.get(column)!r}, rows.jsonl says {a.get(column)!r}"
                )
    return problems or [
        f"{path.name}: differs byte for byte from the CSV derived from rows.jsonl "
        "(its line endings, quoting or columns)"
    ]
