"""A ledger row (:class:`Record`) and the strict reader of ``rows.jsonl``: every row checked
against its own hash, the row before it and the run's contract as it is read."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.paths import open_regular

GENESIS = "0" * 64


MAX_ROW_BYTES = 64 * 2**20  # a row's line: rows take tens of kB, a resample row a few MB


@dataclass
class Record:
    """One ledger line: a completed unit of work, chained to the one before it."""

    seq: int
    key: str
    experiment: str
    data: dict[str, Any]
    worker: str
    timing: dict[str, float]
    prev: str
    contract: str
    hash: str

    def body(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "key": self.key,
            "experiment": self.experiment,
            "data": self.data,
            "worker": self.worker,
            "timing": self.timing,
            "prev": self.prev,
            "contract": self.contract,
        }

    @functools.cached_property
    def row_sha256(self) -> str:
        """SHA-256 of the row's content alone (no timing, worker or chain), so that the
        derived CSVs of a resumed run are byte-identical to an uninterrupted run's."""
        return sha256_json(self.data)

    def expected_hash(self) -> str:
        """``sha256_json(self.body())``, with the row's data (nearly all of its bytes)
        encoded once for this hash, :attr:`row_sha256` and :meth:`line_bytes`: the body's
        keys sort as contract, data, then the rest, so its canonical JSON is spliced
        around the data's."""
        data = canonical(self.data)
        self.__dict__["row_sha256"] = hashlib.sha256(data).hexdigest()  # the cached property
        self.__dict__["_data_bytes"] = data
        return hashlib.sha256(self._spliced(data, self.body())).hexdigest()

    @staticmethod
    def _spliced(data: bytes, body: dict[str, Any]) -> bytes:
        head, tail = Record._around(body)
        return head + data + tail

    @staticmethod
    def _around(body: dict[str, Any]) -> tuple[bytes, bytes]:
        """The canonical JSON of a row's body before its data's, and after it."""
        head = canonical({"contract": body.pop("contract")})[:-1] + b',"data":'
        del body["data"]
        return head, b"," + canonical(body)[1:]

    @classmethod
    def of_checked_line(cls, line: bytes) -> Record:
        """The row of a line that passed the chain check in a file not changed since
        (its bytes are its canonical JSON), parsed by json alone; its
        :attr:`row_sha256` is hashed from the data's own bytes in the line, found by
        encoding the few fields around them, not by encoding the data again."""
        record = cls(**json.loads(line))
        head, tail = cls._around({**record.body(), "hash": record.hash})
        if line.startswith(head) and line.endswith(tail + b"\n"):
            data = memoryview(line)[len(head) : len(line) - len(tail) - 1]
            record.__dict__["row_sha256"] = hashlib.sha256(data).hexdigest()
        return record

    def line_bytes(self) -> bytes:
        """The row's line in rows.jsonl, byte for byte: its canonical JSON (right after
        :meth:`expected_hash`, without encoding the data again; the data's bytes are not
        kept past this call, so a kept row does not hold them twice)."""
        data = self.__dict__.pop("_data_bytes", None) or canonical(self.data)
        return self._spliced(data, {**self.body(), "hash": self.hash}) + b"\n"

    def to_line(self) -> str:
        return self.line_bytes().decode()


ROW_TYPES: dict[str, type] = {
    "seq": int,
    "key": str,
    "experiment": str,
    "data": dict,
    "worker": str,
    "timing": dict,
    "prev": str,
    "contract": str,
    "hash": str,
}


def typed(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


class TamperedLedger(KvreplayError):
    """rows.jsonl does not parse or does not chain; only audit may look further."""


def parse_rows(path: Path, contract_hash: str) -> tuple[list[Record], list[str]]:
    """Read rows.jsonl; return records and a list of problems (empty when intact).

    A torn final line (no newline: a crash mid-append) is not a problem here; callers
    set it aside with :meth:`RunLedger.recover`.
    """
    problems: list[str] = []
    return list(read_rows(path, contract_hash, problems)), problems


def read_rows(path: Path, contract_hash: str, problems: list[str]) -> Iterator[Record]:
    """rows.jsonl a line at a time, each row checked against its hash and chain as it is
    read; what is wrong is appended to ``problems`` (see :func:`parse_rows`). A reader
    that keeps only what it needs of each row holds one row at a time."""
    return (record for _, record in read_rows_at(path, contract_hash, problems))


def _skip_line(handle: Any) -> int:
    """Read past the rest of a line a chunk at a time (nothing held); the bytes read."""
    skipped = 0
    while chunk := handle.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def read_rows_at(
    path: Path, contract_hash: str, problems: list[str]
) -> Iterator[tuple[int, Record]]:
    """:func:`read_rows`, each row with the byte offset of its line (to read it again)."""
    if not path.exists():
        return
    try:
        handle = open_regular(path)
    except OSError as exc:
        problems.append(f"{path.name} cannot be read ({exc.strerror or exc})")
        return
    prev = GENESIS
    offset = 0
    with handle:
        for number, line in enumerate(iter(lambda: handle.readline(MAX_ROW_BYTES + 1), b""), 1):
            at, offset = offset, offset + len(line)
            if len(line) > MAX_ROW_BYTES:
                if not line.endswith(b"\n"):
                    offset += _skip_line(handle)
                problems.append(f"line {number}: longer than {MAX_ROW_BYTES} bytes (no row is)")
                continue
            if not line.endswith(b"\n"):
                return  # the piece after the last newline is torn
            read = _parse_row(line, number, problems)
            if read is None:
                continue
            record, expected = read
            where = f"row {record.key} (line {number})"
            if line != record.line_bytes():
                problems.append(
                    f"{where}: its bytes are not the row's canonical JSON (a byte-order mark, "
                    "a carriage return, other spacing or number spelling)"
                )
            if record.hash != expected:
                problems.append(f"{where}: field hash does not match the row's content")
            if record.prev != prev:
                problems.append(f"{where}: field prev does not chain to the row before it")
            if record.contract != contract_hash:
                problems.append(f"{where}: field contract does not match the manifest")
            if record.seq != number - 1:
                problems.append(f"{where}: field seq is {record.seq}, expected {number - 1}")
            prev = record.hash
            yield at, record


def _parse_row(line: bytes, number: int, problems: list[str]) -> tuple[Record, str] | None:
    """Line ``number`` as a row of the right types, with the hash its content gives; None
    (the problem named) where it is not one."""
    try:
        record = Record(**parse_json(line, finite=False))
    except JsonError as exc:
        problems.append(f"line {number}: does not parse as a ledger row ({exc})")
        return None
    except TypeError:
        problems.append(f"line {number}: does not parse as a ledger row (TypeError)")
        return None
    wrong = [name for name, kind in ROW_TYPES.items() if not typed(getattr(record, name), kind)]
    if wrong:
        problems.append(f"line {number}: field {wrong[0]} has the wrong type")
        return None
    try:
        return record, record.expected_hash()  # canonical: refuses what is not finite
    except ValueError:
        problems.append(
            f"line {number}: does not parse as a ledger row (a number is too large for a float)"
        )
        return None
