"""``kvreplay audit``: re-execute a run's rows from what they recorded and verify every
token sequence, hash, fingerprint and comparison field; verify the hash chain, every
derived CSV and every snapshot. Read-only: an audit never changes the run.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.analysis.derived import check_csvs
from kvreplay.audit.contract import check_contract, check_header, load_audited_items
from kvreplay.audit.crossing import Tally
from kvreplay.audit.exact_bytes import byte_problems
from kvreplay.audit.files import check_files, torn
from kvreplay.audit.manifest_blocks import experiment_block_problems
from kvreplay.audit.plan import check_copies, check_plan, derived_inputs, with_dependencies
from kvreplay.audit.platform import Platform
from kvreplay.audit.reexecute import Reexecution
from kvreplay.audit.request import AuditRequest
from kvreplay.audit.rows import RowChecks
from kvreplay.contract.config import RunConfig
from kvreplay.contract.lock import check_libraries
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.core.planted import planted_fault
from kvreplay.engines.threads import check_recorded, intra_op_threads
from kvreplay.ledger import (
    RunLedger,
    RunRows,
)


@dataclass
class AuditResult:
    run_dir: Path
    platform: Platform = field(default_factory=Platform)
    across: Tally = field(default_factory=Tally)  # rows compared across platforms
    rows_total: int = 0
    rows_reexecuted: int = 0
    problems: list[str] = field(default_factory=list)
    foreign_inputs: int = 0  # rows whose prefix was copied from another run's row

    @property
    def passed(self) -> bool:
        return not self.problems


def audit(
    run_dir: Path,
    request: AuditRequest = AuditRequest(),  # noqa: B008 - a frozen value
    announce: Callable[[str], None] | None = None,
    connection: dict[str, Any] | None = None,
) -> AuditResult:
    """Verify a run; see the module docstring. Bad input raises KvreplayError, and so
    do a fault planted in this process, a thread count other than the one the run
    recorded, library versions other than the run's, and a run whose model ships code
    unless the request trusts it.

    ``connection`` reaches the run's backend (a server's address, which a run does not
    record, so it may differ from the run's). ``announce`` hears, before any re-execution
    starts, where the rows were made as this machine meets it when it is not known to
    be this platform (:class:`~kvreplay.audit.platform.Platform`): rows are then judged
    at the level that crosses platforms.
    """
    fault = planted_fault()
    if fault is not None:
        raise KvreplayError(
            f"The fault {fault} is planted in this process, so an audit would judge the fault, "
            "not the run; audit without it."
        )
    ledger = RunLedger.open_existing(run_dir)
    contract = ledger.manifest["contract"]
    if _runs_model_code(contract) and not request.trust_remote_code:
        raise KvreplayError(
            f"{run_dir} was made with --trust-remote-code, so re-executing it runs the "
            "model's own Python code; pass --trust-remote-code to audit only if you trust it."
        )
    check_libraries(ledger.manifest, run_dir)
    threads = request.placement.threads
    check_recorded(contract, threads, run_dir, "audit")
    with intra_op_threads(threads):
        return _audit(ledger, request, announce, connection or {})


def _runs_model_code(contract: dict[str, Any]) -> bool:
    """Whether a recorded run lets its model's own code run: its backend says so, or
    (an older layout, or a forged mix of both) the run beside it does."""
    run = contract.get("run")
    if not isinstance(run, dict):
        return False
    backend = run.get("backend")
    said = [
        run.get("trust_remote_code"),
        backend.get("trust_remote_code") if isinstance(backend, dict) else None,
    ]
    return True in said


def _audit(
    ledger: RunLedger,
    request: AuditRequest,
    announce: Callable[[str], None] | None,
    connection: dict[str, Any],
) -> AuditResult:
    """Everything that needs no model first (hashes, chain, plan, inputs, derived files),
    then, unless those say the run was forged, the contract on this machine and the rows
    re-executed."""
    result = AuditResult(ledger.run_dir)
    config = RunConfig.from_contract(
        ledger.manifest["contract"].get("run"), str(ledger.run_dir), connection
    )
    item_list, result.problems = load_audited_items(ledger)
    rows, checks, depends = _check_structure(ledger, config, item_list, result)
    if _forged(result.problems):
        return result  # a forged contract, items or chain names no model worth loading
    problems, result.platform = check_contract(ledger, config, item_list, checks.tokenizer)
    result.problems += problems
    if (not result.platform.same or result.platform.pin) and announce is not None:
        announce(result.platform.describe())
    if item_list is None:
        return result
    keys = rows.keys()
    chosen = keys
    if request.sample is not None and request.sample < len(keys):
        chosen = random.Random(request.seed).sample(keys, request.sample)
    replay = Reexecution(
        config,
        request.placement,
        rows.by_key(),
        {i.id: i for i in item_list},
        result.platform,
        sampled_experiments(ledger.manifest),
    )
    result.problems += replay.run(with_dependencies(chosen, keys, depends))
    result.rows_reexecuted = replay.reexecuted
    result.across = replay.tally
    return result


def sampled_experiments(manifest: dict[str, Any]) -> frozenset[str]:
    """The experiments of a run that draw at a temperature above 0 (their config or the
    run's sampler says so): their trajectories part at any draw on another platform."""
    run = manifest["contract"].get("run")
    everywhere = _temperature(run.get("sampler") if isinstance(run, dict) else None) > 0
    experiments = manifest.get("experiments")
    return frozenset(
        name
        for name, entry in (experiments if isinstance(experiments, dict) else {}).items()
        if everywhere or (isinstance(entry, dict) and _temperature(entry.get("config")) > 0)
    )


def _temperature(value: Any) -> float:
    """The highest ``temperature`` a config states anywhere in it (0 if none)."""
    if isinstance(value, dict):
        found = [_temperature(v) for v in value.values()]
        own = value.get("temperature")
        if isinstance(own, int | float) and not isinstance(own, bool):
            found.append(float(own))
        return max(found, default=0.0)
    if isinstance(value, list):
        return max((_temperature(v) for v in value), default=0.0)
    return 0.0


def _check_structure(
    ledger: RunLedger, config: RunConfig, item_list: list[Item] | None, result: AuditResult
) -> tuple[RunRows, RowChecks, dict[str, set[str]]]:
    """Every check that needs no model, each row read once: the manifest's hash, a torn
    last line, derived inputs, each row as it reads, the chain, the header, the plan,
    copied inputs and every derived file. Returns the rows, what reading them found and
    which rows depend on which."""
    if ledger.manifest["contract_sha256"] != ledger.contract_hash:
        result.problems.append("manifest.json: field contract_sha256 does not match the contract")
    if torn(ledger.rows_path):
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
    return rows, checks, depends


# Problems after which loading the model would be pointless or unsafe: the contract, the
# items or the chain no longer say what was run.
HASH_PROBLEMS = ("manifest.json: field contract_sha256", "items.jsonl", "rows.jsonl", "line ")


def _forged(problems: list[str]) -> bool:
    return any(p.startswith(HASH_PROBLEMS) for p in problems)


def format_audit(result: AuditResult) -> str:
    lines = [f"audit of {result.run_dir}"]
    if not result.platform.same or result.platform.pin:
        lines.append(result.platform.describe())
    lines.append(f"rows in ledger: {result.rows_total}; re-executed: {result.rows_reexecuted}")
    if result.rows_reexecuted and not result.platform.same:
        lines += result.across.lines()
    if result.foreign_inputs:
        lines.append(
            f"{result.foreign_inputs} row(s) copy their prefix from another run's row, which "
            "this audit re-executes from the copy but cannot trace further"
        )
    if result.passed and not result.platform.same and result.rows_reexecuted:
        lines.append(
            "PASS: every hash and derived CSV matches, and every re-executed row at the "
            "level that crosses platforms"
        )
    elif result.passed:
        lines.append("PASS: every re-executed row, hash, fingerprint and derived CSV matches")
    else:
        lines.append(f"FAIL: {len(result.problems)} mismatch(es)")
        lines += [f"  - {p}" for p in result.problems]
    return "\n".join(lines)
