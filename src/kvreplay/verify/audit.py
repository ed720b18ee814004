"""``kvreplay audit``: re-execute a run's rows from what they recorded and verify every
token sequence, hash, fingerprint and comparison field; verify the hash chain, every
derived CSV and every snapshot. Read-only: an audit never changes the run.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.backends import precisions
from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import BUILTIN_ITEMS, Item, items_digest, load_jsonl
from kvreplay.core.paths import open_regular
from kvreplay.engines import make_engine
from kvreplay.experiments import recorded_experiment
from kvreplay.experiments.prefixes import trajectory_inputs
from kvreplay.experiments.rows import (
    PREFIX_FIELDS,
    PanelRow,
    row_as_written,
    without_unrecorded_digests,
)
from kvreplay.experiments.tables import recorded_table
from kvreplay.experiments.units import Unit, UnitKey
from kvreplay.model.identity import file_digests
from kvreplay.model.models import load_tokenizer
from kvreplay.run.config import RunConfig
from kvreplay.run.consistency import Scorer, row_problems
from kvreplay.run.derived import check_csvs
from kvreplay.run.environment import contract_scheme
from kvreplay.run.ledger import (
    ITEMS,
    MANIFEST,
    MANIFEST_TYPES,
    ROWS,
    STOPPED,
    Record,
    RunLedger,
    RunRows,
    diff_fields,
)
from kvreplay.run.lock import check_libraries, valid_pin
from kvreplay.run.threads import DEFAULT_THREADS, check_recorded, intra_op_threads
from kvreplay.verify.exact_bytes import byte_problems
from kvreplay.verify.manifest_blocks import experiment_block_problems

if TYPE_CHECKING:
    from kvreplay.experiments.experiment import Experiment
    from kvreplay.model.state import SavedState, SnapshotContents

# Keys that legitimately differ between a run and its re-execution.
UNCHECKED = {"reused_from", "snapshot"}


@dataclass
class AuditResult:
    run_dir: Path
    environment_diff: list[str] = field(default_factory=list)
    rows_total: int = 0
    rows_reexecuted: int = 0
    problems: list[str] = field(default_factory=list)
    foreign_inputs: int = 0  # rows whose prefix was copied from another run's row

    @property
    def passed(self) -> bool:
        return not self.problems


def _repeatable(data: dict[str, Any]) -> dict[str, Any]:
    """A row without its arms served beside background traffic (``--traffic``): what
    they read and decoded depends on what else the server was doing, which no
    re-execution repeats. They stay in the hash chain, and their CSV columns are
    re-derived from the row like every other."""
    arms = data.get("arms")
    if not isinstance(arms, dict):
        return data
    kept = {
        name: arm
        for name, arm in arms.items()
        if not (isinstance(arm, dict) and isinstance(arm.get("served"), dict)
                and "load" in arm["served"])
    }  # fmt: skip
    return {**data, "arms": kept}


def _strip(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip(v) for k, v in data.items() if k not in UNCHECKED}
    if isinstance(data, list):
        return [_strip(v) for v in data]
    return data


def _snapshots(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(arm name, arm record, snapshot entry) of every arm and seeded sample of a row:
    where a run records snapshots (a snapshot named anywhere else names no file this
    run wrote, and check_files says so)."""
    arms = data.get("arms")
    samples = data.get("samples")
    found = [
        (name, arm, arm["snapshot"])
        for name, arm in (arms.items() if isinstance(arms, dict) else ())
        if isinstance(arm, dict) and isinstance(arm.get("snapshot"), dict)
    ]
    for name, seeds in samples.items() if isinstance(samples, dict) else ():
        found += [
            (name, arm, arm["snapshot"])
            for arm in (seeds if isinstance(seeds, list) else ())
            if isinstance(arm, dict) and isinstance(arm.get("snapshot"), dict)
        ]
    return found


Layout = tuple[list[str], list[int]]


def _neutral_lengths(lengths: list[int], tokens: int, layers: int) -> list[int]:
    """The lengths a snapshot's layers may have where the backend cannot say: the
    model's layer count, none past the prefix (a sliding layer may hold fewer), the
    longest over all of it. Its own lengths where they are such, else the prefix's."""
    fits = (
        len(lengths) == layers
        and all(isinstance(n, int) and 0 <= n <= tokens for n in lengths)
        and max(lengths, default=0) == tokens
    )
    return lengths if fits else [tokens] * layers


class SnapshotCheck:
    """Every snapshot a row names, a row at a time: inside the run's snapshots/ folder,
    its bytes' sha256, the fingerprints of the tensors it holds (computed, not read from
    its metadata) against the row's, and everything else it holds against the row and
    the run: exactly the tensors and metadata a snapshot has for a model of ``layers``
    layers, the arm's construction, the row and arm it was saved for, the prefix's token
    ids, and its cache layout: ``layout(tokens)`` where the backend can say it from the
    model's config, else one layout for every snapshot of a precision, no layer past
    the prefix and the longest over all of it."""

    def __init__(self, run_dir: Path, layout: Callable[[int], Layout | None], layers: int):
        self.run_dir, self.layout, self.layers = run_dir, layout, layers
        self.folder = (run_dir / "snapshots").resolve()
        self.seen: dict[Any, str] = {}  # each precision's layer kinds (JSON), where no layout

    def __call__(self, record: Record) -> list[str]:
        problems = []
        for arm_name, arm, entry in _snapshots(record.data):
            name = entry.get("file")
            where = f"row {record.key} snapshot {name}"
            path = self.run_dir / str(name)
            if not isinstance(name, str) or path.resolve().parent != self.folder:
                problems.append(f"{where}: field file does not name a file in snapshots/")
                continue
            if not path.is_file():
                problems.append(f"{where}: missing")
                continue
            if file_digests(path.parent, [path])[path.name] != entry.get("sha256"):
                problems.append(f"{where}: field sha256 does not match the file")
                continue
            from kvreplay.model.state import read_snapshot, read_state_metadata  # torch

            try:
                meta = read_state_metadata(path)
                held = read_snapshot(path)
            except KvreplayError as exc:
                problems.append(f"{where}: {exc}")
                continue
            for key in FINGERPRINTS:
                if getattr(held, key) != arm.get(key):
                    problems.append(f"{where}: its tensors' {key} differs from the row's")
                elif getattr(meta, key) != arm.get(key):
                    problems.append(f"{where}: field {key} of its metadata differs from the row's")
            prefix = record.data.get("prefix_token_ids")
            tokens = len(prefix) if isinstance(prefix, list) else 0
            known = self.layout(tokens)
            if known is None:
                precision = record.data.get("precision")
                kinds = self.seen.setdefault(precision, held.metadata.get("layer_kinds", ""))
                known = (kinds, _neutral_lengths(meta.layer_lengths, tokens, self.layers))
            else:
                known = (json.dumps(known[0]), known[1])
            problems += [
                f"{where}: {p}"
                for p in _snapshot_problems(record, arm_name, arm, meta, held, known)
            ]
        return problems


def _snapshot_problems(
    record: Record,
    arm_name: str,
    arm: dict[str, Any],
    meta: SavedState,
    held: SnapshotContents,
    layout: tuple[str, list[int]],
) -> list[str]:
    """What a snapshot holds besides its fingerprints, against its row (see check_snapshots)."""
    from kvreplay.model.state import SNAPSHOT_EXTRA_TENSORS, SNAPSHOT_METADATA, cache_tensor_names

    kinds, lengths = layout  # kinds as the JSON the metadata holds
    prefix = record.data.get("prefix_token_ids")
    tensors = {*cache_tensor_names(len(lengths)), *SNAPSHOT_EXTRA_TENSORS}
    problems = []
    if held.tensors != tensors:
        odd = sorted(held.tensors ^ tensors)
        problems.append(f"holds other tensors than a snapshot of this model ({odd[0]}, ...)")
    if set(held.metadata) != SNAPSHOT_METADATA:
        odd = sorted(set(held.metadata) ^ SNAPSHOT_METADATA)
        problems.append(f"holds other metadata than a snapshot ({odd[0]}, ...)")
    expected = {
        "construction": (meta.construction, arm.get("construction")),
        "layer_kinds": (held.metadata.get("layer_kinds"), kinds),
        "layer_lengths": (meta.layer_lengths, lengths),
        "extra": (meta.extra, {"arm": arm_name, "row": record.key}),
    }
    problems += [
        f"field {field_name} of its metadata is not the row's"
        for field_name, (value, wanted) in expected.items()
        if value != wanted
    ]
    if held.token_ids != prefix:
        problems.append("its token_ids tensor is not the row's prefix_token_ids")
    return problems


FINGERPRINTS = ("cache_fingerprint", "logits_fingerprint")


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


def read_record(
    record: Record, experiment: Experiment | None
) -> tuple[PanelRow | None, str | None]:
    """A row typed (None where there is nothing to type: a prefix row, an unreached one,
    an experiment this kvreplay does not know), or what is wrong with a row every check
    relies on: a field missing or of the wrong kind, or a completed row that does not
    read as its experiment's typed row."""
    data = record.data
    checks = {
        "item_id": isinstance(data.get("item_id"), str),
        "precision": data.get("precision") in precisions(),
        "status": isinstance(data.get("status"), str),
        "inputs": isinstance(data.get("inputs", {}), dict),
    }
    wrong = next((name for name, ok in checks.items() if not ok), None)
    if wrong is not None:
        return None, f"field {wrong} is missing or malformed"
    if experiment is None or data.get("kind") == "prefix" or data["status"] != "ok":
        return None, None
    try:
        return experiment.read_row(data), None
    except Exception as exc:  # noqa: BLE001 - hand-edited data can fail in any way
        return None, f"does not read as a {record.experiment} row ({type(exc).__name__}: {exc})"


def consistency_problems(record: Record, row: PanelRow | None, scorer: Scorer | None) -> list[str]:
    """What a row says of itself (:mod:`kvreplay.run.consistency`), checked on every row:
    the sample only limits which rows are re-executed. A row whose re-derivation fails
    (a hand-edited field of the wrong kind) is named, not raised."""
    try:
        found = row_problems(record.data, row, scorer)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        found = [f"cannot be re-derived from its own fields ({type(exc).__name__})"]
    return [f"row {record.key}: {p}" for p in found]


def check_contract(
    ledger: RunLedger, config: RunConfig, items: list[Item] | None, tokenizer: Any
) -> tuple[list[str], list[str]]:
    """The recorded contract against its own hash and against the contract this machine
    builds from the recorded run settings, model files and items.jsonl.

    Returns the problems and the machine fields that differ (a note, not a problem).
    """
    from kvreplay.run.runner import build_contract

    problems: list[str] = []
    contract = ledger.manifest["contract"]
    recorded_items = contract.get("items")
    source = recorded_items.get("source", "") if isinstance(recorded_items, dict) else ""
    scheme = contract_scheme(contract)
    info = config.backend.describe_model(config.model, config.trust_remote_code, scheme, tokenizer)
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


def check_plan(ledger: RunLedger, rows: RunRows, item_order: list[str]) -> list[str]:
    """Every experiment's config against its hash and items.jsonl, and its rows against
    the rows that config plans: a missing row is named, so is one nobody planned. The
    plan reads the few rows it depends on (prefix rows, screens) when it asks for them."""
    problems = []
    by_key = rows.by_key()
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
        if "selection" not in config and ids != item_order[: len(ids) if type(ids) is list else 0]:
            problems.append(f"{where}.config.item_ids is not the first items of items.jsonl")
        try:
            planned = experiment.planned(config, by_key)
        except (KeyError, TypeError, AttributeError) as exc:  # a hand-edited config
            problems.append(f"{where}.config is malformed ({type(exc).__name__})")
            continue
        wanted = set(planned)
        stop = entry.get(STOPPED)
        if stop is not None:
            why = stop_problem(experiment, stop, planned, by_key)
            if why:
                problems.append(f"{where}.{STOPPED}: {why}")
            else:
                planned = planned[: planned.index(stop["after"]) + 1]
        problems += [
            f"row {key}: missing from rows.jsonl (planned by experiments.{name}.config)"
            for key in planned
            if key not in by_key
        ]
        problems += [
            f"row {at.key}: not planned by experiments.{name}.config"
            for at in rows.index
            if at.experiment == name and at.key not in wanted
        ]
    problems += [
        f"row {at.key}: field experiment names {at.experiment!r}, which manifest.json does not list"
        for at in rows.index
        if at.experiment not in experiments
    ]
    return problems


def stop_problem(
    experiment: Any, stop: Any, planned: list[str], rows: Mapping[str, Record]
) -> str | None:
    """What is wrong with a recorded early stop, or None: it must name a planned row,
    every row before it must be there and none after it, and its rule must decide at
    that row and not before (so a stop cannot hide rows that would have passed)."""
    from kvreplay.verify.verdict import StopRule

    try:
        rule = StopRule.from_json(experiment, stop["rule"])
        cut = planned.index(stop["after"]) + 1
    except (KeyError, TypeError, ValueError):
        return "is malformed"
    kept = [rows.get(key) for key in planned[:cut]]
    if None in kept or any(key in rows for key in planned[cut:]):
        return "does not match the rows in rows.jsonl"
    ran = [r for r in kept if r is not None]
    if not rule(ran) or rule(ran[:-1]):
        return "its rule does not decide at its last row"
    return None


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
    trust_remote_code: bool = False,
    connection: dict[str, Any] | None = None,
) -> AuditResult:
    """Verify a run; see the module docstring. Bad input raises KvreplayError, and so
    do a ``threads`` count other than the one the run recorded, library versions other
    than the run's, and a run whose model ships code unless ``trust_remote_code``.

    ``connection`` reaches the run's backend (a server's address, which a run does not
    record, so it may differ from the run's). ``announce`` hears, before any re-execution
    starts, which recorded environment
    fields differ from this machine's (a different torch or CPU may change bf16
    results, so a mismatch that follows is then no surprise).
    """
    ledger = RunLedger.open_existing(run_dir)
    contract = ledger.manifest["contract"]
    run = contract.get("run")
    if isinstance(run, dict) and run.get("trust_remote_code") and not trust_remote_code:
        raise KvreplayError(
            f"{run_dir} was made with --trust-remote-code, so re-executing it runs the "
            "model's own Python code; pass --trust-remote-code to audit only if you trust it."
        )
    check_libraries(ledger.manifest, run_dir)
    check_recorded(contract, threads, run_dir, "audit")
    placement = (engine, workers, gpus_per_worker, ray_address)
    with intra_op_threads(threads):
        return _audit(ledger, sample, seed, placement, announce, connection or {})


def _audit(
    ledger: RunLedger,
    sample: int | None,
    seed: int,
    placement: tuple[str, int, float, str | None],
    announce: Callable[[str], None] | None,
    connection: dict[str, Any],
) -> AuditResult:
    run_dir = ledger.run_dir
    result = AuditResult(run_dir)
    run = ledger.manifest["contract"].get("run")
    config = RunConfig.from_contract(run, str(run_dir), connection)
    item_list, result.problems = load_audited_items(ledger)
    # Everything that needs no model first: hashes, chain, plan, inputs, derived files.
    if ledger.manifest["contract_sha256"] != ledger.contract_hash:
        result.problems.append("manifest.json: field contract_sha256 does not match the contract")
    if _torn(ledger.rows_path):
        result.problems.append("rows.jsonl: the last line is torn (an interrupted append)")
    items = {i.id: i for i in item_list or []}
    derived, problems = derived_inputs(ledger, config, items)
    result.problems += problems
    # What the rows say of themselves, against the model's tokenizer and cache layout,
    # where the contract and items still say what was run.
    deep = not _forged(result.problems)
    checks = RowChecks(ledger, derived, config if deep else None, item_list)
    rows, chain = RunRows.checked(ledger.rows_path, ledger.contract_hash, checks.visit)
    result.rows_total = len(rows.index)
    result.problems += chain + checks.problems
    counts = Counter(at.key for at in rows.index)
    result.problems += [f"row {k}: appears more than once" for k in sorted(counts) if counts[k] > 1]
    result.problems += check_header(ledger, checks.holding)
    result.problems += experiment_block_problems(ledger.manifest) + byte_problems(ledger, item_list)
    result.problems += check_plan(ledger, rows, [i.id for i in item_list or []])
    rows = rows.excluding(checks.unread)
    copy_problems, depends, result.foreign_inputs = check_copies(checks.copies, rows, items)
    result.problems += copy_problems
    result.problems += check_csvs(ledger, rows)
    result.problems += check_files(ledger, rows, checks.snapshots)
    if _forged(result.problems):
        return result  # a forged contract, items or chain names no model worth loading
    problems, result.environment_diff = check_contract(ledger, config, item_list, checks.tokenizer)
    result.problems += problems
    if result.environment_diff and announce is not None:
        announce(environment_note(result.environment_diff))
    if item_list is None:
        return result
    keys = rows.keys()
    chosen = keys
    if sample is not None and sample < len(keys):
        chosen = random.Random(seed).sample(keys, sample)
    by_key = rows.by_key()
    units = []
    for key in with_dependencies(chosen, keys, depends):
        record = by_key[key]
        data = record.data
        item: Item | None = items.get(data["item_id"])
        if item is None:
            result.problems.append(f"row {key}: field item_id names no item")
            continue
        unit_key = UnitKey.of(record)
        if str(unit_key) != key:
            result.problems.append(f"row {key}: field item_id or precision is not its key's")
            continue
        inputs = {k: v for k, v in data.get("inputs", {}).items() if k != "reuse"}
        units.append(Unit(unit_key, item, data["precision"], inputs))
    runner = make_engine(config, *placement)
    try:
        for unit, data, _, _ in runner.run(units):
            recorded = row_as_written(by_key[str(unit.key)].data)
            fresh = {**data, "inputs": recorded.get("inputs", {})}
            fresh = without_unrecorded_digests(fresh, recorded)
            for path in diff_fields(_strip(_repeatable(recorded)), _strip(_repeatable(fresh))):
                result.problems.append(f"row {unit.key}: field {path} differs on re-execution")
            result.rows_reexecuted += 1
    finally:
        runner.close()
    return result


def _torn(path: Path) -> bool:
    """Whether rows.jsonl ends inside a line (an interrupted append), read from its end."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open_regular(path) as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"


# Problems after which loading the model would be pointless or unsafe: the contract, the
# items or the chain no longer say what was run.
HASH_PROBLEMS = ("manifest.json: field contract_sha256", "items.jsonl", "rows.jsonl", "line ")


def _forged(problems: list[str]) -> bool:
    return any(p.startswith(HASH_PROBLEMS) for p in problems)


class RowChecks:
    """What an audit checks of each row from the folder alone, as the chain check reads
    it (:meth:`visit`): that it reads as its experiment's row, what it says of itself,
    its inputs against what the run's config derives, and its snapshots. Of each row it
    keeps only what a later check needs (the snapshots it names, the rows its inputs
    copy from), so an audit of any size holds one row at a time. Without ``config`` (a
    forged contract or items) nothing is checked against the model."""

    def __init__(
        self,
        ledger: RunLedger,
        derived: dict[str, dict[str, Any]],
        config: RunConfig | None,
        item_list: list[Item] | None,
    ):
        self.manifest, self.derived = ledger.manifest, derived
        self.problems: list[str] = []
        self.unread: set[str] = set()  # rows that do not read as their experiment's
        self.snapshots: set[str] = set()  # the snapshot files the rows name
        self.holding: str | None = None  # the first row that holds a snapshot
        self.copies: list[Copies] = []
        self.experiments: dict[str, Experiment | None] = {}
        self.tokenizer: Any = None
        self.scorer: Scorer | None = None
        self.snapshot_check: SnapshotCheck | None = None
        if config is not None:
            layout = functools.cache(
                lambda tokens: config.backend.state_layout(
                    config.model, config.trust_remote_code, tokens
                )
            )
            layers = ledger.manifest["contract"].get("model_info", {}).get("num_layers")
            self.snapshot_check = SnapshotCheck(ledger.run_dir, layout, layers)
            self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
            answers = {i.id: i.answer for i in item_list} if item_list is not None else None
            self.scorer = Scorer(self.tokenizer, config.extractor, answers)

    def visit(self, record: Record) -> None:
        snapshots = _snapshots(record.data)
        if snapshots and self.holding is None:
            self.holding = record.key
        if record.experiment not in self.experiments:
            self.experiments[record.experiment] = recorded_experiment(
                record.experiment, self.manifest
            )
        row, why = read_record(record, self.experiments[record.experiment])
        if why is not None:
            self.problems.append(f"row {record.key}: {why}")
            self.unread.add(record.key)
            return
        self.snapshots.update(str(entry.get("file")) for _, _, entry in snapshots)
        self.problems += self.input_problems(record)
        if self.snapshot_check is not None:
            self.problems += self.snapshot_check(record)
            self.problems += consistency_problems(record, row, self.scorer)

    def input_problems(self, record: Record) -> list[str]:
        """What a row's recorded inputs may hold, checked before they are re-executed.

        Re-execution takes no result from the row it re-executes: a ``reuse`` entry (a
        recorded suffix standing in for a computed one) is never recorded by a run, so
        it is named. Inputs an experiment derives from its config and items must be what
        it derives. What they copy from elsewhere is kept to check once every row is
        read (:func:`check_copies`)."""
        inputs = record.data.get("inputs", {})
        where = f"row {record.key}: field inputs"
        problems = []
        if "reuse" in inputs:
            problems.append(f"{where}.reuse stands in for a computed result; no run records it")
        for field_name, value in self.derived.get(record.key, {}).items():
            if canonical(inputs.get(field_name)) != canonical(value):
                problems.append(f"{where}.{field_name} is not what the run's config derives")
        links = tuple(
            (link, _small(target))
            for link in LINKS
            if isinstance(target := inputs.get(link), dict) and isinstance(target.get("key"), str)
        )
        if links or "prefix_sha256" in inputs:
            prefix_row = str(UnitKey.prefix(record.experiment, record.data["item_id"]))
            copies_prefix = prefix_row != record.key and "prefix_sha256" in inputs
            self.copies.append(
                Copies(
                    record.key,
                    prefix_row if copies_prefix else None,
                    links,
                    {name: sha256_json(inputs[name]) for name in PREFIX_FIELDS if name in inputs},
                )
            )
        return problems


# The manifest's header: recorded, never compared by a resume, so checked here for shape.
HEADER: dict[str, Callable[[Any], bool]] = {
    "platform": lambda v: isinstance(v, str),
    "kvreplay_version": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9]+(\.[0-9]+)*\S*", v),
    "git_commit": lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{40}", v)),
    "created": lambda v: (
        isinstance(v, str)
        and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z", v)
    ),
    "command": lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
    "snapshots": lambda v: v in ("saved", "fingerprints only"),
    "environment": lambda v: (
        isinstance(v, dict)
        and isinstance(v.get("python"), str)
        and isinstance(v.get("distributions"), dict)
        and all(valid_pin(name, version) for name, version in v["distributions"].items())
    ),
}


def check_header(ledger: RunLedger, holding: str | None) -> list[str]:
    """Header fields of the right shape, none unknown, and a snapshot setting the rows
    bear out (``holding``: the first row that holds a snapshot). A header is not hashed:
    its content beyond that is the run's word."""
    manifest = ledger.manifest
    problems = [
        f"manifest.json: field {name} is not one a kvreplay run writes"
        for name in manifest
        if name not in HEADER and name not in MANIFEST_TYPES
    ]
    problems += [
        f"manifest.json: field {name} is malformed"
        for name, valid in HEADER.items()
        if name in manifest and not valid(manifest[name])
    ]
    if manifest.get("snapshots") == "fingerprints only" and holding is not None:
        problems.append(
            f"manifest.json: field snapshots says fingerprints only, but row {holding} "
            "holds a snapshot"
        )
    return problems


# What a run folder holds besides its experiments' CSVs and what the audit re-derives.
RUN_FILES = (MANIFEST, ITEMS, ROWS, ".kvreplay.lock", "claims.json", "report.md", "report.html")
TORN = re.compile(r"rows\.torn-[0-9]+\.jsonl")  # a torn last line a resume set aside


def check_files(ledger: RunLedger, rows: RunRows, snapshots: set[str]) -> list[str]:
    """Every file in the run folder is one a run writes (``snapshots``: the files its
    rows name), and each derived file (claims, report, figures) is byte-identical to its
    re-derivation from the checked ledgers."""
    run_dir, experiments = ledger.run_dir, ledger.manifest["experiments"]
    expected = set(RUN_FILES) | {"figures", "snapshots"}
    for name, entry in experiments.items():
        table = recorded_table(name, ledger.manifest)
        if table is not None:
            expected.add(table.csv_name(entry["config"]))
    problems = [
        f"{path.name}: not a file this run wrote"
        for path in sorted(run_dir.iterdir())
        if path.name not in expected and not TORN.fullmatch(path.name)
    ]
    if (run_dir / "snapshots").is_dir():
        problems += [
            f"snapshots/{path.name}: not a snapshot any row names"
            for path in sorted((run_dir / "snapshots").iterdir())
            if f"snapshots/{path.name}" not in snapshots
        ]
    with tempfile.TemporaryDirectory(prefix="kvreplay-audit-") as scratch:
        problems += _check_derived(ledger, rows, Path(scratch))
    return problems


def _check_derived(ledger: RunLedger, rows: RunRows, scratch: Path) -> list[str]:
    """Re-derive claims.json, the report and figures/ into ``scratch`` and compare bytes."""
    from kvreplay.analysis.claims import analyze_dir, write_claims

    run_dir, problems = ledger.run_dir, []
    for name in ledger.manifest["experiments"]:
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is not None:
            experiment.figures(scratch, rows.of(name))
    try:
        if (run_dir / "claims.json").exists():
            write_claims(analyze_dir(run_dir), scratch / "claims.json")
        if (run_dir / "report.md").exists() or (run_dir / "report.html").exists():
            from kvreplay.report.build import build_report

            build_report(run_dir, scratch)
    except (KvreplayError, ValueError, KeyError, TypeError) as exc:
        return [f"claims.json or the report cannot be re-derived from the ledgers ({exc})"]
    derived = [p for p in ("claims.json", "report.md", "report.html") if (run_dir / p).exists()]
    if (run_dir / "figures").is_dir():
        derived += [f"figures/{p.name}" for p in sorted((run_dir / "figures").iterdir())]
    for name in derived:
        mine, theirs = scratch / name, run_dir / name
        if not mine.is_file():
            problems.append(f"{name}: not a file this run's ledgers derive")
        elif not theirs.is_file() or mine.read_bytes() != theirs.read_bytes():
            problems.append(f"{name}: differs from its re-derivation from the ledgers")
    return problems


def load_audited_items(ledger: RunLedger) -> tuple[list[Item] | None, list[str]]:
    """The run's items: a built-in set as this kvreplay builds it (items.jsonl must be
    exactly that), a user's set from items.jsonl (checked against the contract's digest
    by :func:`check_contract`)."""
    recorded = ledger.manifest["contract"].get("items")
    source = recorded.get("source") if isinstance(recorded, dict) else None
    try:
        frozen: list[Item] | None = load_jsonl(ledger.run_dir / ITEMS)
    except KvreplayError as exc:
        return None, [f"items.jsonl: missing or unreadable ({exc})"]
    if source not in BUILTIN_ITEMS:
        return frozen, []
    built = BUILTIN_ITEMS[source]()
    if frozen is not None and items_digest(frozen) != items_digest(built):
        return built, [
            f"items.jsonl: is not the built-in item set {source!r} that the contract names, "
            "as this kvreplay builds it (an item was replaced, added or removed)"
        ]
    return built, []


# Inputs that link a row to the row (or trajectory item) its prefix was copied from.
LINKS = ("source", "historical")


def derived_inputs(
    ledger: RunLedger, config: RunConfig, items: dict[str, Item]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The inputs each row's unit takes from the recorded configs and items alone, by row
    key (see :meth:`Experiment.derived_inputs`), and each config that derives none."""
    derived: dict[str, dict[str, Any]] = {}
    problems = []
    for name, entry in ledger.manifest["experiments"].items():
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is not None:
            try:
                derived |= experiment.derived_inputs(entry["config"], config, items)
            except (KeyError, TypeError, IndexError):
                problems.append(f"manifest.json: field experiments.{name}.config is malformed")
    return derived, problems


NULL = sha256_json(None)  # a prefix field the inputs do not hold


def _small(target: dict[str, Any]) -> dict[str, Any]:
    """What a link's target names: a row's key and hashes (nothing else is compared)."""
    return {k: target[k] for k in ("key", "row_sha256", "prefix_sha256") if k in target}


@dataclass(frozen=True)
class Copies:
    """What a row's inputs say they copy, kept to check once every row is read: its own
    prefix row (where it copies a prefix and is not that row), the links it records, and
    a digest of each prefix field its inputs hold."""

    row: str
    prefix_row: str | None
    links: tuple[tuple[str, dict[str, Any]], ...]
    fields: dict[str, str]


@dataclass(frozen=True)
class Source:
    """A row that another row's inputs copy from, as far as the copy is compared."""

    row_sha256: str
    prefix_sha256: Any
    fields: dict[str, str]

    @classmethod
    def of(cls, record: Record) -> Source:
        data = record.data
        fields = {name: sha256_json(data.get(name)) for name in PREFIX_FIELDS}
        return cls(record.row_sha256, data.get("prefix_sha256"), fields)


def check_copies(
    copies: list[Copies], rows: RunRows, items: dict[str, Item]
) -> tuple[list[str], dict[str, set[str]], int]:
    """Inputs copied from elsewhere: a prefix copied from another row of this run must
    be that row's (which is then re-executed too), and a later phase's prefix its own
    prefix row's; a trajectory item's must be the item's. Returns the problems, each
    row's in-run dependencies, and how many rows copy from another run (which this
    audit cannot re-execute). The rows copied from are read when a copy names them."""
    problems: list[str] = []
    depends: dict[str, set[str]] = {}
    foreign = 0
    by_key = rows.by_key()
    sources: dict[str, Source] = {}

    def copied(where: str, link: str, target: dict[str, Any], copy: Copies, key: str) -> None:
        if key not in sources:
            sources[key] = Source.of(by_key[key])
        source = sources[key]
        depends.setdefault(copy.row, set()).add(key)
        if "row_sha256" in target and target["row_sha256"] != source.row_sha256:
            problems.append(f"{where}.{link}.row_sha256 is not row {key}'s")
        if "prefix_sha256" in target and target["prefix_sha256"] != source.prefix_sha256:
            problems.append(f"{where}.{link}.prefix_sha256 is not row {key}'s")
        problems.extend(
            f"{where}.{name} is not row {key}'s {name}"
            for name, digest in copy.fields.items()
            if digest != source.fields[name]
        )

    for copy in copies:
        where = f"row {copy.row}: field inputs"
        if copy.prefix_row is not None and copy.prefix_row in by_key:
            copied(where, "prefix", {}, copy, copy.prefix_row)
            continue  # the prefix row carries the link to where the prefix came from
        for link, target in copy.links:
            key = target["key"]
            if key.startswith("items.jsonl:"):
                item = items.get(key.removeprefix("items.jsonl:"))
                expected = trajectory_inputs(item) if item and item.prefix_token_ids else None
                if expected is None or any(
                    copy.fields.get(name, NULL) != sha256_json(expected[name])
                    for name in PREFIX_FIELDS
                ):
                    problems.append(f"{where}.{link} names a trajectory item it does not copy")
            elif key in by_key:
                copied(where, link, target, copy, key)
            else:
                foreign += 1
    return problems, depends, foreign


def with_dependencies(
    chosen: list[str], keys: list[str], depends: dict[str, set[str]]
) -> list[str]:
    """The chosen rows and every row of this run their inputs were copied from, in
    ledger order (``keys``): a copied input is vouched for by re-executing the row it
    came from."""
    wanted = set(chosen)
    stack = list(wanted)
    while stack:
        for key in depends.get(stack.pop(), ()):
            if key not in wanted:
                wanted.add(key)
                stack.append(key)
    return [key for key in keys if key in wanted]


def environment_note(fields: list[str]) -> str:
    return "environment differs from the run's in: " + ", ".join(fields)


def format_audit(result: AuditResult) -> str:
    lines = [f"audit of {result.run_dir}"]
    if result.environment_diff:
        lines.append(environment_note(result.environment_diff))
    lines.append(f"rows in ledger: {result.rows_total}; re-executed: {result.rows_reexecuted}")
    if result.foreign_inputs:
        lines.append(
            f"{result.foreign_inputs} row(s) copy their prefix from another run's row, which "
            "this audit re-executes from the copy but cannot trace further"
        )
    if result.passed:
        lines.append("PASS: every re-executed row, hash, fingerprint and derived CSV matches")
    else:
        lines.append(f"FAIL: {len(result.problems)} mismatch(es)")
        lines += [f"  - {p}" for p in result.problems]
    return "\n".join(lines)
