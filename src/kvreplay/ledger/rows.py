"""A run's rows read without holding them: :class:`RunRows` checks the chain once and keeps
each row's place, key, row hash and head, and reads rows again by their place."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, overload

from kvreplay.core.paths import open_regular
from kvreplay.ledger.records import Record, TamperedLedger, read_rows_at


def _stamp(path: Path) -> tuple[int, int, int]:
    """What tells a file changed (its inode, size, modification time); none when absent."""
    try:
        stat = path.stat()
    except OSError:
        return 0, 0, 0
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


# The fields of a row's data that a reader picks rows by (which items reached the
# boundary at every precision, which rows are prefix rows), kept by a run's index.
HEAD = ("item_id", "precision", "kind", "status")


@dataclass(frozen=True)
class RowHead:
    """A row as far as a reader picks rows by it: its key, experiment, row hash and the
    :data:`HEAD` fields of its data (those it has)."""

    key: str
    experiment: str
    row_sha256: str
    data: dict[str, Any]


def _shared(value: Any) -> Any:
    return sys.intern(value) if isinstance(value, str) else value


class RowAt(NamedTuple):
    """Where a row that parsed lies in rows.jsonl, what a reader filters it by, its
    :attr:`Record.row_sha256` (computed once, by the chain check) and its head."""

    offset: int
    key: str
    experiment: str
    row_sha256: str
    head: tuple[tuple[str, Any], ...]


class _Codes:
    """The few distinct values a row's experiment and other head fields take together
    (an experiment, a precision, a kind, a status), each held once; a row holds its
    value's number."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._numbers: dict[str, int] = {}

    def number(self, value: Any) -> int:
        name = json.dumps(value, sort_keys=True)  # any JSON value, hashable or not
        if name not in self._numbers:
            self._numbers[name] = len(self.values)
            self.values.append(value)
        return self._numbers[name]


class RowIndex(Sequence[RowAt]):
    """Every row's :class:`RowAt`, held as columns rather than as objects (about 90
    bytes a row: its offset, its row hash's 32 bytes, its key and item id as UTF-8, and
    one number for its experiment and other head fields together), so that a reader of
    a ledger of any size holds a small fraction of it; a row's :class:`RowAt` is made
    when asked for."""

    def __init__(self) -> None:
        self._offsets = array("q")
        self._hashes = bytearray()
        self._text = bytearray()  # each row's key, then its item id as JSON
        self._ends = array("q")  # where each row's key, then its item id, ends in _text
        self._codes = _Codes()  # (experiment, the other head fields the row has)
        self._code = array("I")

    def append(self, offset: int, record: Record) -> None:
        self._offsets.append(offset)
        self._hashes += bytes.fromhex(record.row_sha256)
        self._text += record.key.encode("utf-8")
        self._ends.append(len(self._text))
        data = record.data
        if "item_id" in data:
            self._text += json.dumps(data["item_id"]).encode("utf-8")
        self._ends.append(len(self._text))
        fields = tuple((name, _shared(data[name])) for name in HEAD[1:] if name in data)
        self._code.append(self._codes.number((sys.intern(record.experiment), fields)))

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, i: int) -> RowAt: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RowAt]: ...
    def __getitem__(self, i: int | slice) -> RowAt | Sequence[RowAt]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        start = self._ends[2 * i - 1] if i else 0
        key_end, item_end = self._ends[2 * i], self._ends[2 * i + 1]
        experiment, fields = self._codes.values[self._code[i]]
        if item_end > key_end:  # the head in HEAD's order: the item id first
            fields = (("item_id", json.loads(self._text[key_end:item_end])), *fields)
        return RowAt(
            self._offsets[i],
            self._text[start:key_end].decode("utf-8"),
            experiment,
            self._hashes[32 * i : 32 * i + 32].hex(),
            fields,
        )

    def __iter__(self) -> Iterator[RowAt]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class RunRows:
    """A run's rows (``experiment``'s only, where named; none of the keys in
    ``without``), read afresh from rows.jsonl each time they are iterated: an analysis
    or audit of any size holds one row at a time. The hash chain is checked once
    (:meth:`checked`), which also notes where each row that parses lies; a later pass
    reads those lines only, and raises if the file changed since (its inode, size or
    modification time). Without an index (checked not ``indexed``) it reads every line
    in file order instead, a line's row hash from its own bytes."""

    path: Path
    stamp: tuple[int, int, int]
    index: Sequence[RowAt] | None
    experiment: str | None = None
    without: frozenset[str] = frozenset()

    @classmethod
    def checked(
        cls,
        path: Path,
        contract_hash: str,
        visit: Callable[[Record], None] | None = None,
        indexed: bool = True,
    ) -> tuple[RunRows, list[str]]:
        """The rows, and what is wrong with them (as :func:`parse_rows` says); ``visit``
        sees each row as it is checked, so that a reader that needs every row once (an
        audit) reads the file once for both. Not ``indexed``, they are read
        in file order (:meth:`_in_file_order`): a reader that only passes over them (an
        analysis) holds nothing a row, not even while they are checked."""
        stamp = _stamp(path)
        problems: list[str] = []
        index = RowIndex() if indexed else None
        for offset, record in read_rows_at(path, contract_hash, problems):
            if index is not None:
                index.append(offset, record)
            if visit is not None:
                visit(record)
        if _stamp(path) != stamp:
            raise TamperedLedger(f"{path} changed while it was read.")
        return cls(path, stamp, index), problems

    def of(self, experiment: str) -> RunRows:
        return dataclasses.replace(self, experiment=experiment)

    def excluding(self, keys: Iterable[str]) -> RunRows:
        return dataclasses.replace(self, without=self.without | frozenset(keys))

    def keys(self) -> list[str]:
        """The keys of the rows this reads, in ledger order."""
        return [at.key for at in self._chosen()]

    def by_key(self) -> RowsByKey:
        """These rows by key, each read when asked for (the last, where a key repeats)."""
        return RowsByKey(self, {at.key: at for at in self._chosen()})

    def _chosen(self) -> Iterator[RowAt]:
        assert self.index is not None, "rows in order have no index"
        return (at for at in self.index if self._picked(at.experiment, at.key))

    def _picked(self, experiment: str, key: str) -> bool:
        return self.experiment in (None, experiment) and key not in self.without

    @contextmanager
    def _reopened(self) -> Iterator[BinaryIO]:
        """rows.jsonl again, refused if it changed since its rows were checked (or while
        it is read)."""
        if _stamp(self.path) != self.stamp:
            raise TamperedLedger(f"{self.path} changed after its rows were checked.")
        try:
            handle = open_regular(self.path)
        except OSError as exc:
            raise TamperedLedger(f"{self.path} cannot be read again ({exc.strerror}).") from exc
        with handle:
            yield handle
        if _stamp(self.path) != self.stamp:
            raise TamperedLedger(f"{self.path} changed while it was read.")

    def read(self, rows: Iterable[RowAt]) -> Iterator[Record]:
        """These rows, in this order. Their lines passed the strict reader and the chain
        check in this very file (its stamp says so), so they are parsed by json alone,
        and their row hashes are not computed again."""
        rows = iter(rows)  # not a list: a pass over every row holds one of them at a time
        if (first := next(rows, None)) is None:
            return  # nothing to read: rows.jsonl is not opened (it may not be a file at all)
        with self._reopened() as handle:
            for at in itertools.chain((first,), rows):
                handle.seek(at.offset)
                record = Record(**json.loads(handle.readline()))
                record.__dict__["row_sha256"] = at.row_sha256  # the cached property
                yield record

    def _in_file_order(self) -> Iterator[Record]:
        """Every row this reads, passing over the file (the torn piece after its last
        newline left out, as the check left it out)."""
        if not self.stamp[1]:
            return  # an empty or absent rows.jsonl: nothing to read
        with self._reopened() as handle:
            for line in handle:
                if not line.endswith(b"\n"):
                    return
                record = Record.of_checked_line(line)
                if self._picked(record.experiment, record.key):
                    yield record

    def __iter__(self) -> Iterator[Record]:
        return self._in_file_order() if self.index is None else self.read(self._chosen())

    def heads(self) -> Iterator[RowHead] | Iterator[Record]:
        """These rows' heads, from the index: rows.jsonl is not read again (without the
        index, the rows themselves)."""
        if self.index is None:
            return iter(self)
        return (
            RowHead(at.key, at.experiment, at.row_sha256, dict(at.head)) for at in self._chosen()
        )


class RowsByKey(Mapping[str, Record]):
    """A run's rows by key, read from rows.jsonl when asked for: a plan or a link
    check looks up a few rows of a ledger of any size without holding it."""

    def __init__(self, rows: RunRows, index: dict[str, RowAt]):
        self._rows, self._index = rows, index

    def __getitem__(self, key: str) -> Record:
        (record,) = self._rows.read([self._index[key]])
        return record

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def heads(records: Iterable[Record]) -> Iterable[Record | RowHead]:
    """Rows as far as a reader picks rows by them (a first pass over which to take):
    a run's rows give their heads without reading rows.jsonl again."""
    return records.heads() if isinstance(records, RunRows) else records


def rows_of(records: Iterable[Record], experiment: str) -> Iterable[Record]:
    """One experiment's rows, as re-readable as ``records`` (a list, or a run's rows)."""
    if isinstance(records, RunRows):
        return records.of(experiment)
    return [r for r in records if r.experiment == experiment]
