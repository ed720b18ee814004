"""The driver of ``kvreplay run``: validate everything, write the manifest, select items,
hand units to an engine phase by phase, append rows, then derive the paper CSV.

Everything that can be refused is refused before any model work; a crash after that
loses no completed row (each is fsynced) and a rerun resumes where it stopped.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from kvreplay.contract.build import build_contract
from kvreplay.contract.config import RunConfig
from kvreplay.contract.environment import git_commit
from kvreplay.contract.lock import check_libraries, installed
from kvreplay.contract.upgrade import current
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item, encode_prompt, frozen_text, is_token_ids, load_items
from kvreplay.core.paths import read_regular
from kvreplay.core.planted import FIELD, planted_fault
from kvreplay.core.stages import StagePlan, opener_ids, plan_budget
from kvreplay.core.version import VERSION
from kvreplay.engines import EngineSession, make_engine
from kvreplay.engines.threads import check_recorded, intra_op_threads
from kvreplay.experiments import get_experiment
from kvreplay.harness.memory import check_memory
from kvreplay.harness.scope import Scope, SourceRun
from kvreplay.harness.units import Unit
from kvreplay.ledger import (
    CONTRACT_SCHEME,
    ENGINE_NOTE,
    ITEMS,
    MANIFEST,
    SNAPSHOTS_SAVED,
    STOPPED,
    Record,
    RunLedger,
    contract_scheme,
    parse_rows,
    write_text_atomic,
)
from kvreplay.model.reading import text_config, vocabulary_size
from kvreplay.run.request import RunRequest
from kvreplay.run.summary import format_summary, summarize
from kvreplay.verify.render import run_sentence


def _check_prompts(
    request: RunRequest, plan: StagePlan, items: list[Item], info: dict[str, Any], tokenizer: Any
) -> None:
    """Prompts over the context window, token ids outside the vocabulary (a trace's, or
    any the tokenizer can produce) and empty openers are refused before model work."""
    budget = plan_budget(plan, tokenizer)
    config = text_config(request.model, request.backend.trusts_remote_code)
    vocabulary = vocabulary_size(config, tokenizer)
    largest = max(max(tokenizer.get_vocab().values()), *tokenizer.all_special_ids)
    if largest >= vocabulary:
        raise KvreplayError(
            f"The tokenizer of model {request.model!r} has token ids up to {largest}, outside "
            f"the model's vocabulary of {vocabulary}; the tokenizer is not this model's."
        )
    for item in items:
        given = item.prompt if is_token_ids(item.prompt) else None
        for where, ids in (("prefix_token_ids", item.prefix_token_ids), ("prompt", given)):
            outside = [t for t in ids or () if t >= vocabulary]  # type: ignore[operator]
            if outside:
                raise KvreplayError(
                    f"Item {item.id} has token id {outside[0]} in {where}, outside the "
                    f"model's vocabulary of {vocabulary}."
                )
        length = (
            len(item.prefix_token_ids)
            if item.prefix_token_ids is not None
            else len(encode_prompt(tokenizer, item.prompt, request.chat)) + budget
        )
        window = request.backend.context_window(info["context_length"])
        if window and length > window:
            raise KvreplayError(
                f"Item {item.id} needs {length} tokens, over the model's context window of "
                f"{window}."
            )


def _check_hits(request: RunRequest, plan: StagePlan, items: list[Item], tokenizer: Any) -> None:
    """A backend that caches whole blocks only (vLLM, a server) reads none of a prefix
    shorter than a block: when every prefix these items can reach is, each hit would
    read no cached token by construction and the run would compare a miss with a miss.
    Refused before the manifest (``items``: those the run may choose; the prefix's
    longest: the prompt, every prefix stage at its cap with its opener, and the next
    stage's opener)."""
    stages = [*plan.prefix_stages, plan.suffix_stages[0]]
    budget = sum(len(opener_ids(tokenizer, s)) for s in stages)
    budget += sum(s.max_new_tokens for s in plan.prefix_stages)
    longest = max(
        len(item.prefix_token_ids)
        if item.prefix_token_ids is not None
        else len(encode_prompt(tokenizer, item.prompt, request.chat)) + budget
        for item in items
    )
    if request.backend.expected_hit(longest - 1) == 0:
        raise KvreplayError(
            f"No prefix of these items can be longer than {longest} tokens, and the "
            f"{request.backend.name} backend caches only whole blocks, each longer than that "
            "(--block-size, or the server's block size), so every hit would read no cached "
            "token and compare a miss with a miss; use a smaller block size."
        )


def _source_run(path: Path | None, config: RunConfig, scheme: int) -> SourceRun | None:
    """Rows of another run, read without touching it (it may still be running), made on
    this run's model: its prefixes are token ids of the model it ran on. (``scheme``:
    this run's identity scheme, whose digest of the model ``config`` holds.)"""
    if path is None:
        return None
    source = RunLedger.open_existing(path)
    recorded = source.manifest["contract"].get("run")
    model = recorded.get("model") if isinstance(recorded, dict) else None
    digest = recorded.get("model_digest") if isinstance(recorded, dict) else None
    if not (isinstance(model, str) and isinstance(digest, str)):
        raise KvreplayError(f"The run {path} (--from) does not record the model it ran on.")
    theirs = contract_scheme(source.manifest["contract"])
    ours = config.model_digest
    if theirs != scheme:  # the model's digest under the scheme the other run used
        info = config.backend.describe_model(config.model, theirs)
        ours = info["model_digest"]
    if digest != ours:
        raise KvreplayError(
            f"The run {path} (--from) ran on the model {model[:80]!r}, not on --model "
            f"{config.model!r}; its prefixes are that model's token ids."
        )
    records, problems = parse_rows(source.rows_path, source.contract_hash)
    if problems:
        raise KvreplayError(f"The run {path} has a damaged ledger ({problems[0]}).")
    return SourceRun(path, {r.key: r for r in records}, source.contract_hash)


def _recorded_scheme(out: Path) -> int:
    """A resumed run keeps the contract scheme it started with; a new one gets today's."""
    if not (out / MANIFEST).exists():
        return CONTRACT_SCHEME
    return contract_scheme(RunLedger.open_existing(out).manifest["contract"])


def _check_resume(request: RunRequest) -> None:
    """A run with rows resumes only on the thread count it recorded (named in the refusal),
    and saving snapshots as it started: its manifest says whether rows hold snapshots."""
    if not (request.out / MANIFEST).exists():
        return
    existing = RunLedger.open_existing(request.out)
    if not existing.has_rows():
        return
    threads = request.placement.threads
    check_recorded(existing.manifest["contract"], threads, request.out, "resume")
    saved = existing.manifest.get("snapshots") == SNAPSHOTS_SAVED
    if saved != request.save_snapshots:
        flag = "with" if saved else "without"
        raise KvreplayError(
            f"{request.out} was started {flag} --save-snapshots; resume it {flag} the flag."
        )


def prepare(request: RunRequest) -> tuple[RunLedger, Scope]:
    """Validate the request and open (or resume) the run directory: everything that can
    be refused is refused before the first write."""
    request.check()
    plan = request.stage_plan()
    experiment = get_experiment(request.experiment, request.backend)
    request.backend.check_installed()  # before anything imports the backend's libraries
    items = load_items(request.items)
    count = experiment.count(request.n, items)
    experiment.check_prompts(items, count)
    scheme = _recorded_scheme(request.out)
    _check_resume(request)
    prompts = [i.prompt for i in items[:count] if i.prompt]
    tokenizer, info = request.backend.admit(
        request.model, request.device, request.dtypes, scheme, prompts, request.chat
    )
    _check_prompts(request, plan, items, info, tokenizer)
    pool = experiment.prompt_pool(items, experiment.count(request.n, items)) or items
    _check_hits(request, plan, pool, tokenizer)
    config = RunConfig(
        model=request.model,
        model_digest=info["model_digest"],
        plan=plan,
        run_dir=str(request.out),
        save_snapshots=request.save_snapshots,
        **request.settings(),
    )
    source = _source_run(request.prefix_from, config, scheme)
    scope = Scope(config, items, tuple(request.dtypes), request.n, source, request.extra)
    experiment.select(scope, scope.source_rows())  # a bad selection is refused before any write
    values, options = experiment.row_values(scope)
    check_memory(values, count * len(request.dtypes), options)
    contract = build_contract(config, info, request.items, items, scheme)
    return _open_ledger(request, contract, items), scope


def _header(request: RunRequest) -> dict[str, Any]:
    """What the manifest records but a resume never compares."""
    return {
        "platform": platform.platform(),
        "environment": {"python": platform.python_version(), "distributions": installed()},
        "kvreplay_version": VERSION,
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": request.command,
        "snapshots": SNAPSHOTS_SAVED if request.save_snapshots else "fingerprints only",
        **({FIELD: fault} if (fault := planted_fault()) else {}),
    }


def _open_ledger(request: RunRequest, contract: dict[str, Any], items: list[Item]) -> RunLedger:
    """Start or resume the run's ledger (a resume on other library versions is refused)
    and freeze its items."""
    ledger = RunLedger(request.out)
    ledger.start(
        contract,
        _header(request),
        on_resume=lambda recorded: check_libraries(recorded, request.out),
        current=current,
    )
    try:
        _freeze_items(ledger, items)
    except BaseException:
        ledger.close()
        raise
    return ledger


def _freeze_items(ledger: RunLedger, items: list[Item]) -> None:
    """Write items.jsonl for a new run; a resumed run's must be what its contract says."""
    path = ledger.run_dir / ITEMS
    text = frozen_text(items)
    if ledger.fresh or not path.exists():
        write_text_atomic(path, text)
    elif _frozen_bytes(path) != text.encode("utf-8"):
        raise KvreplayError(
            f"{path} differs from the items this run's contract records; run kvreplay audit."
        )


class Stop(Protocol):
    """A rule that ends a run early (a check whose verdict is decided): asked with the
    experiment's rows before the first unit and after each row. The manifest records it
    with the last row, so that an audit can tell a deliberate stop from lost rows; the
    run stays resumable."""

    def __call__(self, rows: list[Record]) -> bool: ...

    def to_json(self) -> dict[str, Any]: ...


def decides_at_last(stop: Stop, rows: list[Record]) -> bool:
    """Whether ``stop`` decides at the last of ``rows`` and not before, as an audit
    requires of a recorded stop. A resumed run whose rule decided at an earlier row (a
    check rerun with another ``--expect``) has rows past that point already: it stops
    nowhere and runs every planned row, so that its record never claims a stop it did
    not make."""
    return bool(rows) and stop(rows) and not stop(rows[:-1])


def _frozen_bytes(path: Path) -> bytes:
    try:
        return read_regular(path)
    except OSError as exc:
        raise KvreplayError(
            f"{path} cannot be read as the run's frozen items ({exc.strerror}); run kvreplay audit."
        ) from exc


def run(
    request: RunRequest,
    quiet: bool = False,
    session: EngineSession | None = None,
    stop: Stop | None = None,
) -> dict[str, Any]:
    """Run (or resume) one experiment into ``request.out``; return its summary.

    The run holds the folder's lock (see :mod:`kvreplay.ledger.writer`) from before its first
    write until it returns, so a second run on the same folder is refused. It runs on
    ``request.placement.threads`` torch threads per worker process, which its contract
    records.
    A ``session`` (closed by the caller) keeps its workers and their models for the next
    run; ``stop`` may end it before every unit ran.
    """
    with intra_op_threads(request.placement.threads):
        ledger, scope = prepare(request)
        try:
            return _run_prepared(request, ledger, scope, quiet, session, stop)
        except KvreplayError:
            ledger.abandon()  # refused before its first row: nothing half-written is left
            raise
        finally:
            ledger.close()


def _run_prepared(
    request: RunRequest,
    ledger: RunLedger,
    scope: Scope,
    quiet: bool,
    session: EngineSession | None,
    stop: Stop | None,
) -> dict[str, Any]:
    experiment = get_experiment(request.experiment, request.backend)
    selection = experiment.select(scope, {**scope.source_rows(), **ledger.by_key()})
    recorded = ledger.manifest.get("experiments", {}).get(experiment.name, {}).get("config")
    own = experiment.config(scope, selection)
    ledger.register_experiment(experiment.name, experiment.table.stamp(own, recorded))
    config = ledger.manifest["experiments"][experiment.name]["config"]
    run, placement = scope.config, request.placement
    engine = session.engine(run, placement) if session else make_engine(run, placement)
    try:
        ledger.note_experiment(experiment.name, ENGINE_NOTE, engine.describe())
        name = experiment.name
        done = (lambda: decides_at_last(stop, ledger.rows(name))) if stop else (lambda: False)
        stopped = False
        for phase in range(experiment.phases):
            units = experiment.units(phase, scope, selection, ledger.by_key())
            todo = [u for u in units if not ledger.is_done(str(u.key))]
            stopped = done() or not _run_phase(ledger, engine, todo, quiet, done)
            if stopped:
                break
        last = ledger.rows(experiment.name)[-1].key if stopped else None
        ledger.note_experiment(
            experiment.name,
            STOPPED,
            {"rule": stop.to_json(), "after": last} if stop and last else None,
        )
    finally:
        if session is None:
            engine.close()
    rows = ledger.rows(experiment.name)
    csv_text = experiment.table.csv(rows, config)
    write_text_atomic(request.out / experiment.table.csv_name(config), csv_text)
    experiment.figures(request.out, rows)
    own = experiment.run_summary(rows, config)
    if own is not None:
        if not quiet:
            print(own[1])
        return own[0]
    summary = summarize(experiment, rows)
    if not quiet:
        print(format_summary(experiment, summary))
        print(run_sentence(experiment, rows, config.get("margin")))
    return summary


def _run_phase(
    ledger: RunLedger, engine: Any, units: list[Unit], quiet: bool, done: Callable[[], bool]
) -> bool:
    """Run a phase's units, appending each row; False when ``done`` stopped it early."""
    if not units:
        return True
    bar = tqdm(
        total=len(units), unit="row", disable=quiet, file=sys.stderr, desc=units[0].experiment
    )
    rows = engine.run(units)
    try:
        for unit, data, timing, worker in rows:
            inputs = {k: v for k, v in unit.inputs.items() if k != "reuse"}
            record = {**data, "inputs": inputs}
            ledger.append(str(unit.key), unit.experiment, record, worker, timing)
            bar.update(1)
            if done():
                return False
    finally:
        rows.close()
        bar.close()
    return True
