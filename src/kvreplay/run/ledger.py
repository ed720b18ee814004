"""The run directory's ledger: ``manifest.json`` written before the first row, and
``rows.jsonl``, an append-only, hash-chained, fsynced record of every completed row.

The manifest's ``contract`` holds everything that can change a result (model digests,
library versions, device, threads, dtype flags, plan, items, sampler); resuming refuses
a different contract. Each row commits to the previous row's hash and to the contract's
hash, so a deleted, reordered or edited row breaks the chain where it happened.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.paths import open_regular, probe_folder, read_regular, replace_file
from kvreplay.run.environment import CONTRACT_SCHEME, INFORMATIONAL
from kvreplay.run.runlock import RunLock

RUN_FORMAT = "kvreplay-run-v1"
GENESIS = "0" * 64
MANIFEST = "manifest.json"
ROWS = "rows.jsonl"
ITEMS = "items.jsonl"
SNAPSHOTS_SAVED = "saved"  # the manifest's "snapshots" when rows hold snapshot files
STOPPED = "stopped"  # an experiment's note: the rule that ended it early, and its last row
ENGINE = "engine"  # an experiment's note: where its units ran (the engine's description)
# Each experiment's entry in the manifest: its config, the config's hash, and its notes.
EXPERIMENT_ENTRY: dict[str, type] = {
    "config": dict,
    "config_sha256": str,
    ENGINE: dict,
    STOPPED: dict,
}
MAX_ROW_BYTES = 64 * 2**20  # a row's line: rows take tens of kB, a resample row a few MB
MAX_MANIFEST_BYTES = 64 * 2**20  # manifests take tens of kB (a config lists its item ids)
MANIFEST_TYPES: dict[str, type] = {
    "format": str,
    "contract": dict,
    "contract_sha256": str,
    "experiments": dict,
}


def disk_error(path: Path, exc: OSError) -> KvreplayError:
    """A failed write (a full disk, a read-only folder) as the user's one sentence."""
    return KvreplayError(
        f"Cannot write {path} ({exc.strerror or exc}); fix that and rerun the same command "
        "to resume."
    )


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a new file beside it, fsync, rename (:func:`replace_file`): a reader never
    sees half a file, a failed write leaves neither half a file nor the new one, and a
    name that was a link is replaced, never written through."""
    try:
        replace_file(path, data)
    except OSError as exc:
        raise disk_error(path, exc) from exc


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """manifest.json as a run writes it, byte for byte (an audit holds the file to it)."""
    return json.dumps(manifest, indent=2).encode()


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, text.encode("utf-8"))


def diff_fields(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two JSON-like values differ (for refusals and audits)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                out.append(sub)
            else:
                out += diff_fields(old[key], new[key], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            out += diff_fields(a, b, f"{path}[{index}]")
        return out
    return [] if old == new else [path or "<root>"]


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
        head = canonical({"contract": body.pop("contract")})[:-1]
        del body["data"]
        return head + b',"data":' + data + b"," + canonical(body)[1:]

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


def _typed(value: Any, kind: type) -> bool:
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
            try:
                record = Record(**parse_json(line, finite=False))
            except JsonError as exc:
                problems.append(f"line {number}: does not parse as a ledger row ({exc})")
                continue
            except TypeError:
                problems.append(f"line {number}: does not parse as a ledger row (TypeError)")
                continue
            wrong = [
                name for name, kind in ROW_TYPES.items() if not _typed(getattr(record, name), kind)
            ]
            if wrong:
                problems.append(f"line {number}: field {wrong[0]} has the wrong type")
                continue
            try:
                expected = record.expected_hash()  # canonical: refuses what is not finite
            except ValueError:
                problems.append(
                    f"line {number}: does not parse as a ledger row (a number is too large "
                    "for a float)"
                )
                continue
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


def _not_finite(value: Any, path: str = "data") -> str | None:
    """The first field of ``value`` holding NaN or an infinity, as a dotted path."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if not isinstance(value, dict | list):
        return None
    for key, child in value.items() if isinstance(value, dict) else enumerate(value):
        found = _not_finite(child, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}")
        if found:
            return found
    return None


def _skip_line(handle: Any) -> int:
    """Read past the rest of a line a chunk at a time (nothing held); the bytes read."""
    skipped = 0
    while chunk := handle.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


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


class RunLedger:
    """Owns a run directory's manifest and rows; the only writer of rows.jsonl."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.manifest_path = run_dir / MANIFEST
        self.rows_path = run_dir / ROWS
        self.manifest: dict[str, Any] = {}
        self.records: list[Record] = []
        self._keys: set[str] = set()
        self._lock = RunLock(run_dir)
        self.fresh = False  # True when start() (re)wrote the manifest: no row exists yet

    @property
    def contract_hash(self) -> str:
        return sha256_json(self.manifest["contract"])

    @classmethod
    def open_existing(cls, run_dir: Path) -> RunLedger:
        """Open a run for reading (audit, report); bad input if it is not a run."""
        ledger = cls(run_dir)
        try:
            manifest = parse_json(read_regular(ledger.manifest_path, MAX_MANIFEST_BYTES))
        except (OSError, JsonError) as exc:
            raise KvreplayError(
                f"{run_dir} is not a kvreplay run (no readable manifest.json)."
            ) from exc
        if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT:
            raise KvreplayError(f"{run_dir}/manifest.json is not a kvreplay run manifest.")
        for name, kind in MANIFEST_TYPES.items():
            if not _typed(manifest.get(name), kind):
                raise KvreplayError(
                    f"{run_dir}/manifest.json: field {name} is missing or not a {kind.__name__}."
                )
        scheme = manifest["contract"].get("scheme", 1)
        if not (_typed(scheme, int) and 1 <= scheme <= CONTRACT_SCHEME):
            raise KvreplayError(
                f"{run_dir}/manifest.json: field contract.scheme is {str(scheme)[:20]!r}, not a "
                f"scheme this kvreplay knows (1 to {CONTRACT_SCHEME})."
            )
        for name, entry in manifest["experiments"].items():
            if not (isinstance(entry, dict) and isinstance(entry.get("config"), dict)):
                raise KvreplayError(
                    f"{run_dir}/manifest.json: field experiments.{name}.config is not an object."
                )
        ledger.manifest = manifest
        return ledger

    def has_rows(self) -> bool:
        """Whether rows.jsonl holds anything; a rows.jsonl that is not a regular file (a
        folder cannot be appended to, a FIFO blocks) is refused."""
        if not self.rows_path.exists() and not self.rows_path.is_symlink():
            return False
        if self.rows_path.is_symlink() or not self.rows_path.is_file():
            raise KvreplayError(
                f"{self.rows_path} is not a regular file; remove it or use a new --out folder."
            )
        return self.rows_path.stat().st_size > 0

    def close(self) -> None:
        """End this process's turn as the run's writer."""
        self._lock.release()

    def start(self, contract: dict[str, Any], header: dict[str, Any]) -> None:
        """Create the run, or resume it when its contract is the same.

        ``header`` is recorded but never compared (command line, timestamps).
        """
        contract = json.loads(canonical(contract))  # tuples become lists, as when re-read
        self._lock.acquire()
        try:
            self._open(contract, header)
        except BaseException:
            self.close()  # a refused start ends this writer's turn
            raise

    def _open(self, contract: dict[str, Any], header: dict[str, Any]) -> None:
        try:
            probe_folder(self.run_dir)
        except OSError as exc:
            raise KvreplayError(f"The output folder {self.run_dir} is not writable.") from exc
        if self.has_rows() and not self.manifest_path.exists():
            raise KvreplayError(
                f"{self.run_dir} holds rows.jsonl but no manifest.json; use a new --out folder."
            )
        if self.manifest_path.exists() and self.has_rows():
            from kvreplay.run.lock import check_libraries  # reads installed metadata: resumes only

            existing = RunLedger.open_existing(self.run_dir).manifest
            check_libraries(existing, self.run_dir)
            changed = diff_fields(existing["contract"], contract)
            noted = [path for path in changed if path in INFORMATIONAL]
            if noted:
                print(f"kvreplay: resuming although {', '.join(noted)} differs", file=sys.stderr)
            changed = [path for path in changed if path not in INFORMATIONAL]
            if changed:
                raise KvreplayError(
                    f"{self.run_dir} holds a run with a different contract "
                    f"({', '.join(changed[:4])}); use a new --out folder."
                )
            self.manifest = existing
            self.recover()
            return
        self.manifest = {
            "format": RUN_FORMAT,
            **header,
            "contract": contract,
            "contract_sha256": sha256_json(contract),
            "experiments": {},
        }
        _write_atomic(self.manifest_path, manifest_bytes(self.manifest))
        self.records = []
        self.fresh = True

    def register_experiment(self, name: str, config: dict[str, Any]) -> None:
        """Record an experiment's own settings before its first row; refuse a change."""
        config = json.loads(canonical(config))
        experiments = self.manifest.setdefault("experiments", {})
        if name in experiments:
            changed = diff_fields(experiments[name]["config"], config)
            if changed:
                raise KvreplayError(
                    f"{self.run_dir} already ran {name} with different settings "
                    f"({', '.join(changed[:4])}); use a new --out folder."
                )
            return
        experiments[name] = {"config": config, "config_sha256": sha256_json(config)}
        _write_atomic(self.manifest_path, manifest_bytes(self.manifest))

    def note_experiment(self, name: str, key: str, value: Any) -> None:
        """Record facts about an experiment that do not change results (engine, workers,
        an early stop); None drops the fact."""
        entry = self.manifest["experiments"][name]
        if value is None and key not in entry:
            return
        if value is None:
            del entry[key]
        else:
            entry[key] = value
        _write_atomic(self.manifest_path, manifest_bytes(self.manifest))

    def recover(self) -> None:
        """Load rows; set a torn final line aside; refuse a ledger that does not chain."""
        if self.rows_path.exists():
            raw = self.rows_path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                cut = raw.rfind(b"\n") + 1
                aside = self.run_dir / f"rows.torn-{int(time.time())}.jsonl"
                _write_atomic(aside, raw[cut:])
                with self.rows_path.open("r+b") as handle:
                    handle.truncate(cut)
                    handle.flush()
                    os.fsync(handle.fileno())
                print(f"kvreplay: set aside a torn last row in {aside.name}", file=sys.stderr)
        records, problems = parse_rows(self.rows_path, self.contract_hash)
        if problems:
            raise TamperedLedger(
                f"{self.rows_path} is damaged ({problems[0]}); run kvreplay audit for details."
            )
        self.records = records
        self._keys = {r.key for r in records}

    def abandon(self) -> None:
        """Remove the manifest and items a fresh run wrote before its first row, after
        a refusal: nothing is left that looks like a run, and the folder is as reusable
        as before (a run with rows keeps them all, and resumes)."""
        if self.fresh and not self.records:
            for name in (MANIFEST, ITEMS):
                (self.run_dir / name).unlink(missing_ok=True)

    def is_done(self, key: str) -> bool:
        return key in self._keys

    def by_key(self) -> dict[str, Record]:
        return {r.key: r for r in self.records}

    def rows(self, experiment: str) -> list[Record]:
        return [r for r in self.records if r.experiment == experiment]

    def append(
        self, key: str, experiment: str, data: dict[str, Any], worker: str, timing: dict[str, float]
    ) -> Record:
        """Append one row; flushed and fsynced before this returns."""
        if key in self._keys:
            raise KvreplayError(f"Row {key} is already in the ledger.")
        prev = self.records[-1].hash if self.records else GENESIS
        record = Record(
            seq=len(self.records),
            key=key,
            experiment=experiment,
            data=data,
            worker=worker,
            timing={k: round(v, 6) for k, v in timing.items()},
            prev=prev,
            contract=self.contract_hash,
            hash="",
        )
        try:
            record.hash = record.expected_hash()
        except ValueError as exc:  # canonical JSON refuses NaN and infinities
            raise KvreplayError(
                f"Row {key} holds a number that is not finite (at {_not_finite(data)}): the "
                "model's numbers overflowed at this precision, so the row is not recorded."
            ) from exc
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(self.rows_path, flags, 0o666), "ab") as handle:
                handle.write(record.line_bytes())
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:  # a torn line is set aside when the run resumes
            raise disk_error(self.rows_path, exc) from exc
        self.records.append(record)
        self._keys.add(key)
        return record


# What a spreadsheet runs as a formula when a cell starts with it (OWASP, CSV injection).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def csv_cell(text: str) -> str:
    """A cell that a spreadsheet shows and never runs: text (an item id, an answer) that
    starts with a formula character gets OWASP's leading single quote. A number such as
    -0.5 is left as it is, so numeric columns keep their meaning."""
    if text.startswith(FORMULA_START) and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


def render_csv(columns: list[str], rows: Iterable[dict[str, str]]) -> str:
    """A derived ledger CSV, byte-for-byte reproducible from rows.jsonl."""
    return "".join(render_csv_lines(columns, rows))


def render_csv_lines(columns: list[str], rows: Iterable[dict[str, str]]) -> Iterator[str]:
    """:func:`render_csv` a line at a time (the header first), for a CSV of any length."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    yield buffer.getvalue()
    for row in rows:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow({name: csv_cell(cell) for name, cell in row.items()})
        yield buffer.getvalue()
