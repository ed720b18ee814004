"""``kvreplay check --trainer SPEC``: a gate on the training-inference mismatch between
the run's backend as a rollout stack and a trainer (design: check, mismatch).

The check is a small ``rollout`` run (its own folder, audited and resumed like any
other: ``--n`` items, one rollout each, scored by the stack's own prefill and by the
trainer) judged by :func:`kvreplay.verify.mismatch.judge`. Its options are the
rollout experiment's that a check takes (``--top-k``, ``--logprobs``,
``--max-tokens``, ``--ignore-eos``) and the expectation's (``--expect bitwise``,
``--max-k3-kl``, ``--max-abs-logp``); the live vs prefill check's own options are
refused beside ``--trainer``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.backends.rollout import ScorerSpec
from kvreplay.core.errors import KvreplayError
from kvreplay.verify.mismatch import MismatchVerdict, judge, parse_expectation

ROLLOUT = "rollout"
TAKEN = ("top_k", "logprobs", "max_tokens", "ignore_eos")
"""The rollout experiment's options a check takes (one rollout per item: no --samples)."""
OWN = ("trainer", "max_k3_kl", "max_abs_logp", *TAKEN)
ELSEWHERE = {
    "max_divergent": "--max-divergent",
    "margin": "--margin",
    "samples": "--samples",
    "max_rate": "--max-rate",
    "select": "--select",
    "screen": "--screen",
    "traffic": "--traffic",
}
DEFAULT_ITEMS = 4


def check_options(own_option: Callable[[str, dict[str, Any]], Any]) -> list[Callable[..., Any]]:
    """``kvreplay check``'s options for a mismatch gate: ``--trainer``, the bounds, and
    the rollout experiment's options a check takes, made by ``own_option`` (the CLI's
    maker of an experiment's option) from the rollout declaration."""
    import click

    from kvreplay.experiments.registry import declared

    fields = declared()[ROLLOUT].option_fields()
    return [
        click.option(
            "--trainer", default=None,
            help="Gate the training-inference mismatch instead: the backend under test "
                 "samples rollouts, this scorer (BACKEND:PRECISION[:SCHEDULE][@MODEL], e.g. "
                 "hf:fp32, or engine:replay) teacher-forces them; see docs/experiments/rollout.md.",
        ),
        click.option("--max-k3-kl", type=float, default=None,
                     help="With --trainer: the largest k3 KL estimate that passes (default 1e-3)."),
        click.option("--max-abs-logp", type=float, default=None,
                     help="With --trainer: the largest |delta log p| any token may have."),
        *(own_option(key, fields[key]) for key in TAKEN),
    ]  # fmt: skip


def without_options(options: dict[str, Any]) -> dict[str, Any]:
    """A live vs prefill check's options without the mismatch gate's; one given without
    ``--trainer`` is refused."""
    given = next((k for k in OWN if options.get(k) not in (None, False)), None)
    if given is not None:
        raise KvreplayError(
            f"--{given.replace('_', '-')} applies to a mismatch check; give --trainer too."
        )
    return {k: v for k, v in options.items() if k not in OWN}


def run_mismatch_check(
    options: dict[str, Any],
    make_request: Callable[[str, Path, dict[str, Any]], Any],
    echo: Callable[[str], None],
    command: list[str],
) -> MismatchVerdict:
    """Run (or resume) the rollout run a ``--trainer`` check asks for, print its verdict,
    write its outputs and return it; every refusal comes before the run writes."""
    from kvreplay.experiments.rollout.sides import read_sides
    from kvreplay.experiments.rollout.table import ROLLOUT_TABLE
    from kvreplay.run.ledger import RunLedger, parse_rows
    from kvreplay.run.runner import run
    from kvreplay.verify.check import _environment, check_outputs, default_out, write_outputs

    options = dict(options)
    take = options.pop
    trainer = ScorerSpec.parse(take("trainer"))
    expectation = parse_expectation(take("expect"), take("max_k3_kl"), take("max_abs_logp"))
    for key, flag in ELSEWHERE.items():
        if options.get(key) not in (None, False, 0):
            raise KvreplayError(f"{flag} applies to the live vs prefill check, not to --trainer.")
    out, json_path, junit_path = (take(k) for k in ("out", "json_path", "junit_path"))
    repro = take("repro")
    if repro is not None:
        raise KvreplayError("--repro applies to the live vs prefill check, not to --trainer.")
    options["n"] = options["n"] if options["n"] is not None else DEFAULT_ITEMS
    options["scorers"] = trainer.label
    out = out or _default_out(default_out(options), trainer.label)
    check_outputs(out, json_path, junit_path, out.with_name(out.name + ".repro"))
    request = make_request(ROLLOUT, out, options)
    run(request, quiet=True)
    ledger = RunLedger.open_existing(out)
    records, _ = parse_rows(ledger.rows_path, ledger.contract_hash)
    rows = [r for r in records if r.experiment == ROLLOUT and r.data["status"] == "ok"]
    config = ledger.manifest["experiments"][ROLLOUT]["config"]
    sides = read_sides(ROLLOUT_TABLE.ledger(rows, config)) if rows else {}
    rollout = f"{request.backend.name}:{','.join(config['dtypes'])}"
    temperature = float(config["sampling"]["temperature"])
    environment = _environment(ledger.manifest)
    verdict = judge(sides, trainer.label, expectation, rollout, temperature, environment)
    echo(verdict.screen())
    write_outputs(verdict, json_path, junit_path)  # type: ignore[arg-type]
    echo(f"check run: {out} (kvreplay audit {out} re-executes it)")
    return verdict


def _default_out(base: Path, trainer: str) -> Path:
    return base.with_name(base.name + "-vs-" + re.sub(r"[^A-Za-z0-9._-]+", "-", trainer))
