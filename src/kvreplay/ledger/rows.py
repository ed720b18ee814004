"""A run's rows read without holding them: :class:`RunRows` checks the chain once and keeps
each row's place, key, row hash and head, and reads rows again by their place."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

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


def _head(data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A row's head fields; the few values they take (precisions, kinds, statuses) are
    held once for the whole index."""
    return tuple(
        (name, _shared(data[name]) if name != "item_id" else data[name])
        for name in HEAD
        if name in data
    )


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


@dataclass(frozen=True)
class RunRows:
    """A run's rows (``experiment``'s only, where named; none of the keys in
    ``without``), read afresh from rows.jsonl each time they are iterated: an analysis
    or audit of any size holds one row at a time. The hash chain is checked once
    (:meth:`checked`), which also notes where each row that parses lies; a later pass
    reads those lines only, and raises if the file changed since (its inode, size or
    modification time)."""

    path: Path
    stamp: tuple[int, int, int]
    index: tuple[RowAt, ...]
    experiment: str | None = None
    without: frozenset[str] = frozenset()

    @classmethod
    def checked(
        cls, path: Path, contract_hash: str, visit: Callable[[Record], None] | None = None
    ) -> tuple[RunRows, list[str]]:
        """The rows, and what is wrong with them (as :func:`parse_rows` says); ``visit``
        sees each row as it is checked, so that a reader that needs every row once (an
        audit) reads the file once for both."""
        stamp = _stamp(path)
        problems: list[str] = []
        index = []
        for offset, record in read_rows_at(path, contract_hash, problems):
            head = _head(record.data)
            index.append(RowAt(offset, record.key, record.experiment, record.row_sha256, head))
            if visit is not None:
                visit(record)
        if _stamp(path) != stamp:
            raise TamperedLedger(f"{path} changed while it was read.")
        return cls(path, stamp, tuple(index)), problems

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
        return (
            at
            for at in self.index
            if self.experiment in (None, at.experiment) and at.key not in self.without
        )

    def read(self, rows: Iterable[RowAt]) -> Iterator[Record]:
        """These rows, in this order. Their lines passed the strict reader and the chain
        check in this very file (its stamp says so), so they are parsed by json alone,
        and their row hashes are not computed again."""
        rows = list(rows)
        if not rows:
            return  # nothing to read: rows.jsonl is not opened (it may not be a file at all)
        if _stamp(self.path) != self.stamp:
            raise TamperedLedger(f"{self.path} changed after its rows were checked.")
        try:
            handle = open_regular(self.path)
        except OSError as exc:
            raise TamperedLedger(f"{self.path} cannot be read again ({exc.strerror}).") from exc
        with handle:
            for at in rows:
                handle.seek(at.offset)
                record = Record(**json.loads(handle.readline()))
                record.__dict__["row_sha256"] = at.row_sha256  # the cached property
                yield record
        if _stamp(self.path) != self.stamp:
            raise TamperedLedger(f"{self.path} changed while it was read.")

    def __iter__(self) -> Iterator[Record]:
        return self.read(list(self._chosen()))

    def heads(self) -> Iterator[RowHead]:
        """These rows' heads, from the index: rows.jsonl is not read again."""
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
