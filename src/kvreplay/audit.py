"""``kvreplay audit``: re-execute a run's rows from what they recorded and verify every
token sequence, hash, fingerprint and comparison field; verify the hash chain, every
derived CSV and every snapshot. Read-only: an audit never changes the run.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.canonical import canonical, sha256_json
from kvreplay.config import RunConfig
from kvreplay.engines import make_engine
from kvreplay.environment import contract_scheme
from kvreplay.errors import KvreplayError
from kvreplay.experiments import recorded_experiment
from kvreplay.experiments.units import Unit, UnitKey
from kvreplay.items import Item, load_jsonl
from kvreplay.ledger import (
    ITEMS,
    Record,
    RunLedger,
    diff_fields,
    parse_rows,
    render_csv,
)
from kvreplay.lock import check_libraries
from kvreplay.models import DTYPES, describe_source, file_digests
from kvreplay.state import read_state_metadata
from kvreplay.threads import DEFAULT_THREADS, check_recorded, intra_op_threads

# Keys that legitimately differ between a run and its re-execution.
UNCHECKED = {"reused_from", "snapshot"}


@dataclass
class AuditResult:
    run_dir: Path
    environment_diff: list[str] = field(default_factory=list)
    rows_total: int = 0
    rows_reexecuted: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def _strip(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip(v) for k, v in data.items() if k not in UNCHECKED}
    if isinstance(data, list):
        return [_strip(v) for v in data]
    return data


def check_csvs(ledger: RunLedger, records: list[Record], present_only: bool = False) -> list[str]:
    """Each experiment's CSV must equal the one derived from rows.jsonl, cell for cell;
    ``present_only`` skips experiments whose CSV is not written yet (a run in progress)."""
    problems = []
    for name in ledger.manifest.get("experiments", {}):
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is None:
            problems.append(f"experiment {name}: unknown to this kvreplay version")
            continue
        path = ledger.run_dir / experiment.csv_name(ledger.manifest["experiments"][name]["config"])
        if present_only and not path.exists():
            continue
        rows = [r for r in records if r.experiment == name]
        try:
            expected = render_csv(experiment.columns, experiment.csv_rows(rows))
        except (KeyError, TypeError, IndexError, ValueError) as exc:  # hand-edited row data
            problems.append(f"{path.name}: cannot be derived from rows.jsonl ({exc!r})")
            continue
        if not path.exists():
            problems.append(f"{path.name}: missing although {name} has rows")
            continue
        try:
            actual = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            problems.append(f"{path.name}: not UTF-8 text")
            continue
        if actual == expected:
            continue
        want = list(csv.DictReader(io.StringIO(expected)))
        have = list(csv.DictReader(io.StringIO(actual)))
        if len(want) != len(have):
            problems.append(f"{path.name}: {len(have)} rows, rows.jsonl derives {len(want)}")
        for a, b in zip(want, have, strict=False):
            for column in experiment.columns:
                if a.get(column) != b.get(column):
                    problems.append(
                        f"{path.name} row {a.get('row_id')} ({a.get('precision', '')})"
                        f": field {column} is {b.get(column)!r}, rows.jsonl says {a.get(column)!r}"
                    )
        if not problems or not problems[-1].startswith(path.name):
            problems.append(f"{path.name}: differs from the CSV derived from rows.jsonl")
    return problems


def _snapshots(data: Any) -> list[tuple[str, dict[str, Any]]]:
    """(arm fingerprint record, snapshot entry) pairs anywhere in a row."""
    found = []
    if isinstance(data, dict):
        if isinstance(data.get("snapshot"), dict):
            found.append((data, data["snapshot"]))
        for value in data.values():
            found += _snapshots(value)
    elif isinstance(data, list):
        for value in data:
            found += _snapshots(value)
    return found


def check_snapshots(run_dir: Path, records: list[Record]) -> list[str]:
    problems = []
    for record in records:
        for arm, entry in _snapshots(record.data):
            path = run_dir / entry["file"]
            where = f"row {record.key} snapshot {entry['file']}"
            if not path.is_file():
                problems.append(f"{where}: missing")
                continue
            if file_digests(path.parent, [path])[path.name] != entry["sha256"]:
                problems.append(f"{where}: field sha256 does not match the file")
                continue
            meta = read_state_metadata(path)
            for key in ("cache_fingerprint", "logits_fingerprint"):
                if getattr(meta, key) != arm[key]:
                    problems.append(f"{where}: field {key} differs from the row")
    return problems


# Environment fields that describe the machine rather than the software stack: an audit
# elsewhere announces them (a bf16 mismatch that follows is then no surprise). The thread
# count is not one of them: the audit runs on the count the run recorded or refuses.
MACHINE_FIELDS = (
    "platform",
    "machine",
    "system",
    "libc",
    "cpu_capability",
    "device_name",
)


def malformed_field(record: Record) -> str | None:
    """The first row field every check relies on that is missing or of the wrong kind."""
    data = record.data
    checks = {
        "item_id": isinstance(data.get("item_id"), str),
        "precision": data.get("precision") in DTYPES,
        "status": isinstance(data.get("status"), str),
        "inputs": isinstance(data.get("inputs", {}), dict),
    }
    return next((name for name, ok in checks.items() if not ok), None)


def check_contract(
    ledger: RunLedger, config: RunConfig, items: list[Item] | None
) -> tuple[list[str], list[str]]:
    """The recorded contract against its own hash and against the contract this machine
    builds from the recorded run settings, model files and items.jsonl.

    Returns the problems and the machine fields that differ (a note, not a problem).
    """
    from kvreplay.runner import build_contract

    manifest, problems = ledger.manifest, []
    contract = manifest["contract"]
    if manifest["contract_sha256"] != ledger.contract_hash:
        problems.append("manifest.json: field contract_sha256 does not match the contract")
    recorded_items = contract.get("items")
    source = recorded_items.get("source", "") if isinstance(recorded_items, dict) else ""
    scheme = contract_scheme(contract)
    info = describe_source(config.model, config.trust_remote_code, scheme)
    built = json.loads(canonical(build_contract(config, info, source, items or [], scheme)))
    if items is None:
        built["items"] = recorded_items  # already named as unreadable
    noted = []
    for path in diff_fields(contract, built):
        field_name = path.removeprefix("environment.")
        if path.startswith("environment.") and field_name in MACHINE_FIELDS:
            noted.append(field_name)
        elif path.startswith("items"):
            problems.append(
                f"items.jsonl: does not match the contract's record of the items (field "
                f"contract.{path}): an item was edited, added or removed"
            )
        else:
            problems.append(
                f"manifest.json: field contract.{path} differs from what this machine builds "
                "from the run's settings and files"
            )
    return problems, noted


def check_plan(ledger: RunLedger, records: list[Record], item_order: list[str]) -> list[str]:
    """Every experiment's config against its hash and items.jsonl, and its rows against
    the rows that config plans: a missing row is named, so is one nobody planned."""
    problems = []
    rows = {r.key: r for r in records}
    experiments = ledger.manifest["experiments"]
    for name, entry in experiments.items():
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is None:
            continue  # named by check_csvs
        where = f"manifest.json: field experiments.{name}"
        config = entry["config"]
        if entry.get("config_sha256") != sha256_json(config):
            problems.append(f"{where}.config_sha256 does not match its config")
        ids = config.get("item_ids")
        if "selection" not in config and ids != item_order[: len(ids or [])]:
            problems.append(f"{where}.config.item_ids is not the first items of items.jsonl")
        try:
            planned = experiment.planned(config, rows)
        except (KeyError, TypeError, AttributeError) as exc:  # a hand-edited config
            problems.append(f"{where}.config is malformed ({type(exc).__name__})")
            continue
        wanted = set(planned)
        problems += [
            f"row {key}: missing from rows.jsonl (planned by experiments.{name}.config)"
            for key in planned
            if key not in rows
        ]
        problems += [
            f"row {r.key}: not planned by experiments.{name}.config"
            for r in records
            if r.experiment == name and r.key not in wanted
        ]
    problems += [
        f"row {r.key}: field experiment names {r.experiment!r}, which manifest.json does not list"
        for r in records
        if r.experiment not in experiments
    ]
    return problems


def audit(
    run_dir: Path,
    sample: int | None = None,
    seed: int = 0,
    engine: str = "local",
    workers: int = 1,
    gpus_per_worker: float = 0.0,
    ray_address: str | None = None,
    announce: Callable[[str], None] | None = None,
    threads: int = DEFAULT_THREADS,
) -> AuditResult:
    """Verify a run; see the module docstring. Bad input raises KvreplayError, and so
    does a ``threads`` count other than the one the run recorded.

    ``announce`` hears, before any re-execution starts, which recorded environment
    fields differ from this machine's (a different torch or CPU may change bf16
    results, so a mismatch that follows is then no surprise).
    """
    ledger = RunLedger.open_existing(run_dir)
    check_libraries(ledger.manifest["contract"], run_dir)
    check_recorded(ledger.manifest["contract"], threads, run_dir, "audit")
    placement = (engine, workers, gpus_per_worker, ray_address)
    with intra_op_threads(threads):
        return _audit(ledger, sample, seed, placement, announce)


def _audit(
    ledger: RunLedger,
    sample: int | None,
    seed: int,
    placement: tuple[str, int, float, str | None],
    announce: Callable[[str], None] | None,
) -> AuditResult:
    run_dir = ledger.run_dir
    result = AuditResult(run_dir)
    config = RunConfig.from_contract(ledger.manifest["contract"].get("run"), str(run_dir))
    try:
        item_list: list[Item] | None = load_jsonl(run_dir / ITEMS)
    except KvreplayError as exc:
        result.problems.append(f"items.jsonl: missing or unreadable ({exc})")
        item_list = None
    problems, result.environment_diff = check_contract(ledger, config, item_list)
    result.problems += problems
    if result.environment_diff and announce is not None:
        announce(environment_note(result.environment_diff))
    raw = ledger.rows_path.read_bytes() if ledger.rows_path.exists() else b""
    if raw and not raw.endswith(b"\n"):
        result.problems.append("rows.jsonl: the last line is torn (an interrupted append)")
    records, chain = parse_rows(ledger.rows_path, ledger.contract_hash)
    result.rows_total = len(records)
    result.problems += chain
    keys = [r.key for r in records]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        result.problems.append(f"row {key}: appears more than once")
    result.problems += check_plan(ledger, records, [i.id for i in item_list or []])
    malformed = {r.key: name for r in records if (name := malformed_field(r))}
    result.problems += [
        f"row {k}: field {name} is missing or malformed" for k, name in malformed.items()
    ]
    records = [r for r in records if r.key not in malformed]
    result.problems += check_csvs(ledger, records)
    result.problems += check_snapshots(run_dir, records)
    if item_list is None:
        return result
    items = {i.id: i for i in item_list}
    chosen = records
    if sample is not None and sample < len(records):
        chosen = sorted(random.Random(seed).sample(records, sample), key=lambda r: r.seq)
    units = []
    for record in chosen:
        data = record.data
        item: Item | None = items.get(data["item_id"])
        if item is None:
            result.problems.append(f"row {record.key}: field item_id names no item")
            continue
        key = UnitKey.of(record)
        if str(key) != record.key:
            result.problems.append(f"row {record.key}: field item_id or precision is not its key's")
            continue
        units.append(Unit(key, item, data["precision"], data.get("inputs", {})))
    runner = make_engine(config, *placement)
    by_key = {r.key: r for r in chosen}
    try:
        for unit, data, _, _ in runner.run(units):
            recorded = by_key[str(unit.key)].data
            fresh = {**data, "inputs": recorded.get("inputs", {})}
            for path in diff_fields(_strip(recorded), _strip(fresh)):
                result.problems.append(f"row {unit.key}: field {path} differs on re-execution")
            result.rows_reexecuted += 1
    finally:
        runner.close()
    return result


def environment_note(fields: list[str]) -> str:
    return "environment differs from the run's in: " + ", ".join(fields)


def format_audit(result: AuditResult) -> str:
    lines = [f"audit of {result.run_dir}"]
    if result.environment_diff:
        lines.append(environment_note(result.environment_diff))
    lines.append(f"rows in ledger: {result.rows_total}; re-executed: {result.rows_reexecuted}")
    if result.passed:
        lines.append("PASS: every re-executed row, hash, fingerprint and derived CSV matches")
    else:
        lines.append(f"FAIL: {len(result.problems)} mismatch(es)")
        lines += [f"  - {p}" for p in result.problems]
    return "\n".join(lines)
