"""``kvreplay check --trainer SPEC``: a gate on the training-inference mismatch between
the run's backend as a rollout stack and a trainer (design: check, mismatch).

The check is a small ``rollout`` run (its own folder, audited and resumed like any
other: ``--n`` items, one rollout each, scored by the stack's own prefill and by the
trainer) judged by :func:`kvreplay.verify.mismatch.judge`. It takes the rollout
experiment's options a check takes (:data:`TAKEN`) and the expectation's (``--expect
bitwise``, ``--max-k3-kl``, ``--max-abs-logp``); the live vs prefill check's own options
are refused beside ``--trainer``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvreplay.backends.rollout import ScorerSpec
from kvreplay.core.errors import KvreplayError
from kvreplay.run.enginelog import engine_log, run_line
from kvreplay.run.outputs import check_outputs, recorded_environment, write_outputs
from kvreplay.run.request import RunOptions, RunRequest
from kvreplay.verify.mismatch import MismatchBounds, MismatchVerdict, judge, parse_expectation
from kvreplay.verify.mismatch_render import mismatch_json, mismatch_junit, mismatch_screen

ROLLOUT = "rollout"
TAKEN = ("top_k", "logprobs", "max_tokens", "ignore_eos")
"""The rollout experiment's options a check takes (one rollout per item: no --samples)."""
# A live vs prefill check's own options, refused beside --trainer.
ELSEWHERE = ("max_divergent", "margin", "samples", "max_rate", "repro")


def run_mismatch_check(
    request: Any,  # a kvreplay.run.check.CheckRequest
    echo: Callable[[str], None],
    defaults: tuple[int, Path],
) -> MismatchVerdict:
    """Run (or resume) the rollout run a ``--trainer`` check asks for, print its verdict,
    write its outputs and return it; every refusal comes before the run writes.
    ``defaults``: the items a check runs without ``--n``, and its default folder."""
    from kvreplay.experiments.rollout.sides import read_sides
    from kvreplay.experiments.rollout.table import ROLLOUT_TABLE
    from kvreplay.ledger import RunLedger, parse_rows
    from kvreplay.run.runner import run

    assert request.trainer is not None
    trainer = ScorerSpec.parse(request.trainer)
    expectation = parse_expectation(request.expect, request.bounds)
    _refuse_elsewhere(request)
    items, default_out = defaults
    out = request.out or _default_out(default_out, trainer.label)
    reads = (request.items, request.model, request.plan, trainer.model)
    check_outputs(out, reads, request.json_path, request.junit_path, verbose=request.verbose)
    shared = {f.name: getattr(request, f.name) for f in fields(RunOptions)}
    extra = {**request.own, "scorers": trainer.label}
    run_request = RunRequest(
        **shared | {"n": request.n if request.n is not None else items},
        experiment=ROLLOUT, out=out, extra=extra, command=request.command,
    )  # fmt: skip
    with engine_log(out, request.verbose):
        run(run_request, quiet=True)
    ledger = RunLedger.open_existing(out)
    records, _ = parse_rows(ledger.rows_path, ledger.contract_hash)
    rows = [r for r in records if r.experiment == ROLLOUT and r.data["status"] == "ok"]
    config = ledger.manifest["experiments"][ROLLOUT]["config"]
    sides = read_sides(ROLLOUT_TABLE.ledger(rows, config)) if rows else {}
    rollout = f"{request.backend.name}:{','.join(config['dtypes'])}"
    temperature = float(config["sampling"]["temperature"])
    environment = recorded_environment(ledger.manifest)
    verdict = judge(sides, trainer.label, expectation, rollout, temperature, environment)
    echo(mismatch_screen(verdict))
    rendered = (mismatch_json(verdict), mismatch_junit(verdict))
    write_outputs(rendered, request.json_path, request.junit_path)
    echo(run_line(out, request.verbose))
    return verdict


def _refuse_elsewhere(request: Any) -> None:
    """The live vs prefill check's options (and its experiment's) are not a mismatch
    check's."""
    from kvreplay.core.options import declared

    specs = declared(type(request))
    for key in ELSEWHERE:
        if getattr(request, key) not in (None, False):
            raise KvreplayError(
                f"{specs[key].flag} applies to the live vs prefill check, not to --trainer."
            )
    other = sorted(set(request.own) - set(TAKEN))
    if other or request.backend.traffic_clients:
        flag = "--traffic" if not other else "--" + other[0].replace("_", "-")
        raise KvreplayError(f"{flag} applies to the live vs prefill check, not to --trainer.")


def refuse_without_trainer(request: Any) -> None:
    """A mismatch check's own options given to a live vs prefill check are refused."""
    from kvreplay.core.options import declared

    for key, spec in declared(MismatchBounds).items():
        if getattr(request.bounds, key) is not None:
            raise KvreplayError(f"{spec.flag} applies to a mismatch check; give --trainer too.")
    taken = sorted(set(request.own) & set(TAKEN))
    if taken:
        flag = "--" + taken[0].replace("_", "-")
        raise KvreplayError(f"{flag} applies to a mismatch check; give --trainer too.")


def _default_out(base: Path, trainer: str) -> Path:
    return base.with_name(base.name + "-vs-" + re.sub(r"[^A-Za-z0-9._-]+", "-", trainer))
