"""A paper-named CSV, declared once (design: table): its file, its columns in order, the
columns that key a row, and the gates a reader checks. kvreplay writes it from an
experiment's rows with :meth:`Table.csv`, and analysis reads it back with
:func:`read_ledger` into typed columns, failing closed: a missing column, a repeated
row, a bad boolean, number or hash, or a flag that disagrees with the hashes it
summarises stops the reading with one sentence naming file, row and field.

A run records the version of its CSV's schema in its experiment's config
(``schema_version``); a run recorded before versions existed is version 1. A column a
later version adds is rendered only for runs of that version, so every earlier run
still re-derives byte for byte. Plain data and numpy, no torch."""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.dtypes import StringDType

from kvreplay.core.errors import KvreplayError
from kvreplay.harness.columns import Column, Field, Kind, csv_value, parse_cell
from kvreplay.harness.held import Held, HeldColumn, column_for, id_column, mapped, unpacked
from kvreplay.ledger import Record, csv_reader, render_csv_lines

SCHEMA_VERSION = "schema_version"
"""The key of an experiment's config that records its CSV's schema version."""

Check = Callable[["Ledger"], None]
LineCheck = Callable[[Mapping[str, Any], Mapping[str, Any]], "tuple[str, str] | None"]
"""A gate on one typed line of a table that is not held, given the first line too: the
column and the problem, or None."""
NAME = "{name}"  # in a table's file: the part a run names (kv_transplant_{name}.csv)
RUN_NAME = re.compile(r"[A-Za-z0-9_-]+")


def recorded_version(config: Mapping[str, Any]) -> int:
    """The schema version a run's experiment config records; 1 before versions existed."""
    return int(config.get(SCHEMA_VERSION, 1))


@dataclass(frozen=True, eq=False)  # a table is one declaration: equal only to itself
class Table:
    """A CSV and how it is read. A table kvreplay writes names its ``experiment`` and
    ``lines``, which types the experiment's rows into the lines its columns read (one
    at a time, reading the rows as often as it needs: they may be a run read afresh
    each time, see :class:`~kvreplay.ledger.RunRows`); a CSV only the paper's release
    has names neither. ``marker`` tells this table from another
    of the same file: the CSV has that column (a served backend's ``backend``).

    A table that is not ``held`` has lines too large to hold (a line of the rollout CSV
    is a whole response's log-probabilities): its ledger keeps no column, and a reader
    reads its lines again, a typed line at a time, each checked as it is read
    (:meth:`Ledger.lines`, gated by ``line_checks``)."""

    file: str
    columns: tuple[Field, ...]
    experiment: str | None = None
    lines: Callable[[Iterable[Record]], Iterator[Any]] | None = None
    key: tuple[str, ...] = ("row_id",)
    checks: tuple[Check, ...] = ()
    marker: str | None = None
    held: bool = True
    line_checks: tuple[LineCheck, ...] = ()

    @property
    def name(self) -> str:
        """The table as a registry names it: its file, and its marker where it has one."""
        return self.file if self.marker is None else f"{self.file} ({self.marker})"

    @property
    def version(self) -> int:
        """The schema version of a new run: the latest that added a column."""
        return max(column.since for column in self.columns)

    def kind(self, column: str) -> Kind:
        """A column's kind, by name."""
        return next(c.kind for c in self.columns if c.name == column)

    def matches(self, file_name: str) -> bool:
        return self._pattern.fullmatch(file_name) is not None

    def named(self, file_name: str) -> str:
        """The name a run gave its file (``later`` in kv_transplant_later.csv)."""
        match = self._pattern.fullmatch(file_name)
        assert match is not None and match.groups(), f"{file_name} is not a {self.file}"
        return match.group(1)

    @property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.file).replace(re.escape(NAME), f"({RUN_NAME.pattern})"))

    def csv_name(self, config: Mapping[str, Any]) -> str:
        """The file a run writes: the table's own, or the one its config names."""
        return config["csv_name"] if NAME in self.file else self.file

    def stamp(self, config: dict[str, Any], recorded: Mapping[str, Any] | None) -> dict[str, Any]:
        """``config`` with the schema version the run records: this table's for a new
        run; for a resumed one what it recorded (a run from before versions, none)."""
        if recorded is not None and SCHEMA_VERSION not in recorded:
            return config
        version = recorded[SCHEMA_VERSION] if recorded is not None else self.version
        return {**config, SCHEMA_VERSION: version}

    def header(self, config: Mapping[str, Any]) -> list[str]:
        return [column.name for column in self._written(recorded_version(config))]

    def csv(self, rows: Iterable[Record], config: Mapping[str, Any]) -> str:
        """The CSV of an experiment's rows, at the schema version its config records."""
        return "".join(self.csv_lines(rows, config))

    def csv_lines(self, rows: Iterable[Record], config: Mapping[str, Any]) -> Iterator[str]:
        """:meth:`csv` a line at a time, the header first."""
        assert self.lines is not None, f"kvreplay does not write {self.file}"
        columns = self._written(recorded_version(config))
        lines = ({c.name: csv_value(c.get(line)) for c in columns} for line in self.lines(rows))
        return render_csv_lines([c.name for c in columns], lines)

    def ledger(self, rows: list[Record], config: Mapping[str, Any]) -> Ledger:
        """The ledger analysis reads from the CSV of these rows."""
        name = self.csv_name(config)

        def reread() -> Iterator[list[str]]:
            return _rows_of(csv_reader(self.csv_lines(rows, config)))

        if not self.held:
            return Ledger.streamed(name, self, reread)
        return parse_ledger(name, reread(), self, reread)

    def _written(self, version: int) -> list[Column[Any]]:
        return [c for c in self.columns if isinstance(c, Column) and c.since <= version]


class LedgerError(KvreplayError, ValueError):
    """A ledger that cannot be trusted; the message names file, row id and field."""

    def __init__(
        self, file: str, problem: str, row_id: str | None = None, field: str | None = None
    ):
        row = "header" if row_id == "header" else row_id and f"row {row_id}"
        where = ", ".join(part for part in (file, row, field and f"field {field}") if part)
        super().__init__(f"{where}: {problem}.")
        self.file, self.row_id, self.field, self.problem = file, row_id, field, problem


Reread = Callable[[], Iterator[list[str]]]
"""A ledger's CSV lines, read again from where they came (its file, or a run's rows)."""


@dataclass(frozen=True)
class Ledger:
    """One validated CSV as typed numpy columns (optional numbers hold NaN when empty),
    of its held columns only (a digest column holds each digest's 32 bytes, a flag
    column its bits), with the table it was read as and how to read its lines again
    (``reread``): of a table that is not held that is all it has. A part of it
    (:meth:`select`) is the positions of its rows: a column of a part is taken when
    asked for, not copied for every column."""

    file: str
    table: Table
    held_row_ids: np.ndarray
    held: Mapping[str, Held]
    reread: Reread | None = None
    part: np.ndarray | None = None

    @classmethod
    def streamed(cls, file: str, table: Table, reread: Reread) -> Ledger:
        return cls(file, table, np.empty(0, dtype=object), {}, reread)

    def lines(self) -> Iterator[dict[str, Any]]:
        """Its lines again, every column typed (held or not) and checked as they are
        read; a defect raises :class:`LedgerError` naming file, row and field."""
        assert self.reread is not None, f"{self.file} was not read from lines"
        return checked_lines(self.file, self.reread(), self.table)

    @property
    def row_ids(self) -> np.ndarray:
        return self._take(self.held_row_ids)

    def row_id(self, i: int) -> str:
        """Row ``i``'s id (of a part, its ``i``-th row's), without taking the others."""
        return str(self.held_row_ids[i if self.part is None else self.part[i]])

    def __len__(self) -> int:
        return int(self.held_row_ids.shape[0] if self.part is None else self.part.shape[0])

    def __getitem__(self, column: str) -> np.ndarray:
        return self._take(unpacked(self.held[column]))

    def __contains__(self, column: object) -> bool:
        return column in self.held

    def _take(self, values: np.ndarray) -> np.ndarray:
        return values if self.part is None else values[self.part]

    def select(self, mask: np.ndarray) -> Ledger:
        """Rows where mask is true, in file order (a part: its lines are not read again)."""
        positions = np.flatnonzero(mask).astype(np.min_scalar_type(len(mask)))  # not 8 bytes
        part = positions if self.part is None else self.part[positions]
        return replace(self, reread=None, part=part)

    def require(self, ok: np.ndarray, column: str, problem: str) -> None:
        """Fail closed on the first row where ok is false."""
        bad = np.flatnonzero(~ok)
        if bad.size:
            raise LedgerError(self.file, problem, str(self.row_ids[bad[0]]), column)


def read_header(path: Path) -> list[str]:
    """A CSV's header, or none if it cannot be read (read_ledger names the problem)."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return next(csv_reader(handle), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return []


def _rows_of(lines: Iterable[list[str]]) -> Iterator[list[str]]:
    return (line for line in lines if line)


def _file_rows(path: Path) -> Iterator[list[str]]:
    """A CSV file's non-empty rows, a defect of the file raised as LedgerError."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            yield from _rows_of(csv_reader(handle))
    except UnicodeDecodeError:
        raise LedgerError(path.name, "the file is not UTF-8 text") from None
    except (OSError, csv.Error) as error:
        raise LedgerError(path.name, f"the file cannot be read as CSV ({error})") from None


def read_ledger(path: Path, table: Table) -> Ledger:
    """Parse and validate one CSV file as ``table``, a line at a time (what it holds is
    the typed columns, never the file's text); any defect raises LedgerError. A table
    that is not held is checked here for its header only, and its lines as a reader
    reads them."""
    if not table.held:
        rows = _file_rows(path)
        try:
            header = next(rows, None)
        finally:
            rows.close()
        if header is None:
            raise LedgerError(path.name, "the file has no header row")
        _header_kinds(path.name, header, table)
        return Ledger.streamed(path.name, table, lambda: _file_rows(path))
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            lines = (line for line in csv_reader(handle) if line)
            count = sum(1 for _ in _file_rows(path)) - 1  # the rows: each column's size
            return parse_ledger(path.name, lines, table, lambda: _file_rows(path), count)
    except UnicodeDecodeError:
        raise LedgerError(path.name, "the file is not UTF-8 text") from None
    except (OSError, csv.Error) as error:
        raise LedgerError(path.name, f"the file cannot be read as CSV ({error})") from None


def _header_kinds(name: str, header: list[str], table: Table) -> dict[str, Kind]:
    """The columns a CSV is read for, by kind: every required one (refused if missing)
    and each optional one it has; its header must name each column once."""
    required = [c.name for c in table.columns if c.use == "required"]
    for column in ["row_id", *required]:
        if column not in header:
            raise LedgerError(name, "the column is missing", "header", column)
    if len(set(header)) != len(header):
        repeated = next(c for c in header if header.count(c) > 1)
        raise LedgerError(name, "the column appears twice", "header", repeated)
    kinds = {
        c.name: c.kind
        for c in table.columns
        if c.use == "required" or (c.use == "optional" and c.name in header)
    }
    kinds.pop("row_id", None)
    return kinds


class _Keys:
    """Each line's key once, held as a 16-byte digest (where a set of them would take
    about 100 bytes a row), a few thousand lines checked at a time against sorted runs
    of the earlier ones; runs of equal size merge, as a binary counter carries, so a
    ledger of n lines is sorted in n log n, not in n squared. A key seen twice is named
    by the first line that repeats an earlier one's, as a set would name it, at most a
    chunk of lines later. The lines waiting for their check are held in two arrays, not
    as an object each, which would keep the allocator's pages of every chunk."""

    CHUNK = 4096
    DIGEST = np.dtype("V16")

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []  # sorted digests, each run at least twice the next
        self.digests = np.zeros(self.CHUNK, dtype=self.DIGEST)  # the lines waiting
        self.row_ids = np.zeros(self.CHUNK, dtype=StringDType())
        self.waiting = 0
        self.count = 0

    def add(self, key: str, row_id: str) -> str | None:
        """The row id of a line whose key an earlier line had, when a chunk is checked."""
        self.digests[self.waiting] = hashlib.blake2b(key.encode(), digest_size=16).digest()
        self.row_ids[self.waiting] = row_id
        self.waiting += 1
        self.count += 1
        return self.check() if self.waiting == self.CHUNK else None

    def check(self) -> str | None:
        """Check the lines added since the last check; the first repeating one's row id."""
        if not self.waiting:
            return None
        digests = self.digests[: self.waiting]
        order = np.argsort(digests, kind="stable")  # equal digests in line order
        ordered = digests[order]
        twice = [order[1:][ordered[1:] == ordered[:-1]]]
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, digests), run.size - 1)
            twice.append(np.flatnonzero(run[at] == digests))
        if (found := np.concatenate(twice)).size:
            self.waiting = 0  # named: a reader stops here (a chunk that repeats is not kept)
            return str(self.row_ids[int(found.min())])
        run = ordered
        while self.runs and self.runs[-1].size <= run.size:
            last = self.runs.pop()
            merged = mapped(last.size + run.size, self.DIGEST)  # as large as the rows
            merged[: last.size], merged[last.size :] = last, run
            merged.sort()
            run = merged
        self.runs.append(run)
        self.waiting = 0
        return None


def _rows(
    name: str, lines: Iterable[list[str]], table: Table
) -> tuple[dict[str, Kind], Iterator[tuple[str, dict[str, str]]]]:
    """A CSV's columns read, by kind (its header checked), and its rows, each checked
    as it is read for its fields, its id and its key (each key once, kept as a digest):
    a row's id and its cells by column."""
    lines = iter(lines)
    header = next(lines, None)
    if header is None:
        raise LedgerError(name, "the file has no header row")
    kinds = _header_kinds(name, header, table)
    index = {column: header.index(column) for column in ["row_id", *kinds]}
    keys = [index[c] for c in table.key]

    def rows() -> Iterator[tuple[str, dict[str, str]]]:
        seen = _Keys()
        for line_number, cells in enumerate(lines, start=2):
            row_id = cells[index["row_id"]] if len(cells) > index["row_id"] else ""
            label = row_id or f"at line {line_number}"
            if len(cells) != len(header):
                problem = f"the row has {len(cells)} fields but the header has {len(header)}"
                raise LedgerError(name, problem, label, "row_id")
            if not row_id:
                raise LedgerError(name, "the row id is empty", label, "row_id")
            if (twice := seen.add("\x00".join(cells[i] for i in keys), row_id)) is not None:
                raise LedgerError(name, "the row id appears twice", twice, "row_id")
            yield row_id, {column: cells[index[column]] for column in kinds}
        if (twice := seen.check()) is not None:
            raise LedgerError(name, "the row id appears twice", twice, "row_id")
        if not seen.count:
            raise LedgerError(name, "the ledger has a header but no rows")

    return kinds, rows()


def _read(name: str, row_id: str, column: str, read: Callable[..., Any], *cell: Any) -> Any:
    """A cell read (``read(*cell)``), its defect raised as LedgerError naming file, row
    and field."""
    try:
        return read(*cell)
    except ValueError as error:
        raise LedgerError(name, f"the value {error}", row_id, column) from None
    except OverflowError:
        raise LedgerError(name, "the value is too large", row_id, column) from None


def checked_lines(name: str, lines: Iterable[list[str]], table: Table) -> Iterator[dict[str, Any]]:
    """The lines of a CSV as ``table``, each typed (every column it reads, by name) and
    checked as it is read: its fields, its key, and the table's line checks; any defect
    raises LedgerError naming ``name``."""
    kinds, rows = _rows(name, lines, table)
    first: dict[str, Any] | None = None
    for row_id, cells in rows:
        typed: dict[str, Any] = {"row_id": row_id}
        for column, kind in kinds.items():
            typed[column] = _read(name, row_id, column, parse_cell, kind, cells[column])
        first = first or typed
        for check in table.line_checks:
            found = check(typed, first)
            if found is not None:
                raise LedgerError(name, found[1], row_id, found[0])
        yield typed


def parse_ledger(
    name: str,
    lines: Iterable[list[str]],
    table: Table,
    reread: Reread | None = None,
    rows: int = 4096,
) -> Ledger:
    """Validate a CSV's lines as ``table``: its required columns, and its optional ones
    where present; any defect raises LedgerError naming ``name``. The lines are read
    and checked one at a time, and only the held columns kept (``reread``: how to read
    the lines again; ``rows``: how many there are, where known, to size the columns)."""
    held = {c.name for c in table.columns if c.held and c.name != "row_id"}
    columns: dict[str, HeldColumn] | None = None
    row_ids = id_column(rows)
    for typed in checked_lines(name, lines, table):
        if columns is None:  # the columns this CSV has, from its first line
            columns = {c: column_for(table.kind(c), rows) for c in typed if c in held}
        for column, values in columns.items():
            values.append(typed[column])
        row_ids.append(typed["row_id"])
    ledger = Ledger(
        name,
        table,
        row_ids.finish(),
        {column: values.finish() for column, values in (columns or {}).items()},
        reread,
    )
    for check in table.checks:
        check(ledger)
    return ledger


def check_equal_flag(flag: str, left: str, right: str, *, equal: bool = True) -> LineCheck:
    """Gate on each line: a boolean column must say whether two hash columns agree."""
    relation = "are equal" if equal else "differ"

    def check(line: Mapping[str, Any], _first: Mapping[str, Any]) -> tuple[str, str] | None:
        if line[flag] == ((line[left] == line[right]) == equal):
            return None
        return flag, f"it must be true exactly when {left} and {right} {relation}"

    return check


def check_same(column: str) -> Check:
    """Gate: a column that describes the whole ledger holds one value on every row."""

    def check(ledger: Ledger) -> None:
        ledger.require(
            ledger[column] == ledger[column][0], column, "it must be the same on every row"
        )

    return check
