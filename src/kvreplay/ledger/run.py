"""The run directory's ledger: ``manifest.json`` written before the first row, and
``rows.jsonl``, an append-only, hash-chained, fsynced record of every completed row.

The manifest's ``contract`` holds everything that can change a result (model digests,
library versions, device, threads, dtype flags, plan, items, sampler); resuming refuses
a different contract. Each row commits to the previous row's hash and to the contract's
hash, so a deleted, reordered or edited row breaks the chain where it happened.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.paths import probe_folder, read_regular
from kvreplay.core.planted import FIELD, planted_fault
from kvreplay.ledger.files import disk_error, write_atomic
from kvreplay.ledger.records import GENESIS, Record, TamperedLedger, parse_rows, typed
from kvreplay.ledger.writer import RunLock

RUN_FORMAT = "kvreplay-run-v1"
MANIFEST = "manifest.json"
ROWS = "rows.jsonl"
ITEMS = "items.jsonl"
ENGINE_LOG = "engine.log"  # a check's engine output, kept apart from its verdict
SNAPSHOTS_SAVED = "saved"  # the manifest's "snapshots" when rows hold snapshot files
STOPPED = "stopped"  # an experiment's note: the rule that ended it early, and its last row
# The newest contract scheme (see kvreplay.contract.environment); a contract that names none
# is scheme 1. A difference in an INFORMATIONAL field is reported on resume, never refused.
ENGINE_NOTE = "engine"  # an experiment's note: where its units ran (an engines/ description)
# Each experiment's entry in the manifest: its config, the config's hash, and its notes.
EXPERIMENT_ENTRY: dict[str, type] = {
    "config": dict,
    "config_sha256": str,
    ENGINE_NOTE: dict,
    STOPPED: dict,
}
MAX_MANIFEST_BYTES = 64 * 2**20  # manifests take tens of kB (a config lists its item ids)
CONTRACT_SCHEME = 4
INFORMATIONAL = ("environment.platform",)
# What a run records of its environment beside the contract (run/runner.py: _header).
HEADER_ENVIRONMENT = ("python", "distributions")
MANIFEST_TYPES: dict[str, type] = {
    "format": str,
    "contract": dict,
    "contract_sha256": str,
    "experiments": dict,
}


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


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """manifest.json as a run writes it, byte for byte (an audit holds the file to it)."""
    return json.dumps(manifest, indent=2).encode()


def check_planted(run_dir: Path, manifest: dict[str, Any]) -> None:
    """A run is read with the fault it was made with planted, and no other (design:
    fault): its manifest's one field :data:`~kvreplay.core.planted.FIELD` against the
    fault planted in this process. Nothing else in a manifest is read as a fault."""
    recorded, now = manifest.get(FIELD), planted_fault()
    if recorded is not None and not isinstance(recorded, str):
        raise KvreplayError(f"{run_dir}/manifest.json: field {FIELD} is not a string.")
    if recorded == now:
        return
    if recorded is None:
        raise KvreplayError(
            f"The fault {now} is planted in this process, but the run in {run_dir} was made "
            "without it; run kvreplay on it without the fault."
        )
    raise KvreplayError(
        f"The run in {run_dir} was made with the planted fault {recorded} (its manifest's "
        f"field {FIELD}); read or resume it only with that fault planted "
        f"(python -m kvreplay.faults {recorded} -- ...)."
    )


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
            if not typed(manifest.get(name), kind):
                raise KvreplayError(
                    f"{run_dir}/manifest.json: field {name} is missing or not a {kind.__name__}."
                )
        scheme = manifest["contract"].get("scheme", 1)
        if not (typed(scheme, int) and 1 <= scheme <= CONTRACT_SCHEME):
            raise KvreplayError(
                f"{run_dir}/manifest.json: field contract.scheme is {str(scheme)[:20]!r}, not a "
                f"scheme this kvreplay knows (1 to {CONTRACT_SCHEME})."
            )
        recorded = manifest.get("environment")
        for key in recorded if isinstance(recorded, dict) else ():
            if key not in HEADER_ENVIRONMENT:
                raise KvreplayError(
                    f"{run_dir}/manifest.json: field environment.{str(key)[:40]} is not one a "
                    f"kvreplay run writes (it records {' and '.join(HEADER_ENVIRONMENT)}); "
                    "kvreplay reads no run folder whose manifest adds to its environment."
                )
        check_planted(run_dir, manifest)
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

    def start(
        self,
        contract: dict[str, Any],
        header: dict[str, Any],
        on_resume: Callable[[dict[str, Any]], None] | None = None,
        current: Callable[[dict[str, Any]], dict[str, Any]] = lambda contract: contract,
    ) -> None:
        """Create the run, or resume it when its contract is the same.

        ``header`` is recorded but never compared (command line, timestamps);
        ``on_resume`` sees the recorded manifest of a run with rows before anything else
        is compared (the runner refuses other library versions there), and ``current``
        reads a recorded contract in the layout ``contract`` is built in (a contract of
        an older layout keeps its bytes and its hash).
        """
        contract = json.loads(canonical(contract))  # tuples become lists, as when re-read
        self._lock.acquire()
        try:
            self._open(contract, header, on_resume, current)
        except BaseException:
            self.close()  # a refused start ends this writer's turn
            raise

    def _open(
        self,
        contract: dict[str, Any],
        header: dict[str, Any],
        on_resume: Callable[[dict[str, Any]], None] | None,
        current: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> None:
        try:
            probe_folder(self.run_dir)
        except OSError as exc:
            raise KvreplayError(f"The output folder {self.run_dir} is not writable.") from exc
        if self.has_rows() and not self.manifest_path.exists():
            raise KvreplayError(
                f"{self.run_dir} holds rows.jsonl but no manifest.json; use a new --out folder."
            )
        if self.manifest_path.exists() and self.has_rows():
            existing = RunLedger.open_existing(self.run_dir).manifest
            if on_resume is not None:
                on_resume(existing)
            changed = diff_fields(current(existing["contract"]), contract)
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
        write_atomic(self.manifest_path, manifest_bytes(self.manifest))
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
        write_atomic(self.manifest_path, manifest_bytes(self.manifest))

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
        write_atomic(self.manifest_path, manifest_bytes(self.manifest))

    def recover(self) -> None:
        """Load rows; set a torn final line aside; refuse a ledger that does not chain."""
        if self.rows_path.exists():
            raw = self.rows_path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                cut = raw.rfind(b"\n") + 1
                aside = self.run_dir / f"rows.torn-{int(time.time())}.jsonl"
                write_atomic(aside, raw[cut:])
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


def contract_scheme(contract: dict[str, Any]) -> int:
    """The scheme a recorded contract was written in (scheme 1 did not say)."""
    return int(contract.get("scheme", 1))
