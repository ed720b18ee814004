"""``kvreplay check``: a verdict on a stack in a minute, for people and for CI.

A check is a small run of the experiment a check role names (design: check): live vs
prefill on a backend with K/V access, a prefix-cache hit vs a miss on a served one, each
with its replica (``matched``); the resample certificate at temperature > 0; the hit
under traffic beside the hit alone and the miss under ``--traffic N``. Its rows are
judged against an expectation (:mod:`kvreplay.verify.verdict`). It is itself a run
folder, so ``kvreplay audit`` re-executes it and rerunning it resumes it. Its outputs:
the verdict on screen, ``--json``, ``--junit``, and a repro pack for the first divergent
item (:mod:`kvreplay.run.repro`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvreplay.backends import DEFAULT_BACKEND
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import COUNTS, Declared, arguments, option
from kvreplay.core.options import declared as declared_options
from kvreplay.core.planted import FIELD
from kvreplay.core.registry import load
from kvreplay.experiments.battery.table import BATTERY
from kvreplay.experiments.registry import check_experiment, declared
from kvreplay.harness.gate import Gate, GateRequest, Judged
from kvreplay.ledger import RunLedger, parse_rows
from kvreplay.run.enginelog import engine_log, run_line
from kvreplay.run.outputs import check_outputs, recorded_environment, write_outputs
from kvreplay.run.repro import repro_pack
from kvreplay.run.request import RunOptions, RunRequest
from kvreplay.verify.expectation import DEFAULT_MARGIN, EXPECTATIONS, Expectation, parse_expectation
from kvreplay.verify.render import SCHEMA, junit, screen, sentence, to_json
from kvreplay.verify.verdict import StopRule, judge

DEFAULT_ITEMS = 4  # items a check runs without --n or --max-rate
BATTERY_ITEMS = 1  # a battery's items without --n: every shape of one item, a minute cold
DEFAULT_SAMPLES = 8  # seeded samples per item at temperature > 0
USER_PRECISION = "bf16"  # what a check compares at without --dtypes, but for a battery
# The shared run options whose default a check sets otherwise than a run: the precision
# is the check's own choice (CheckRequest.dtypes, :func:`precisions`), as its help says.
CHECK_DEFAULTS: dict[str, Any] = {"dtypes": None}
BATTERY_TAKES = ("shapes",)  # the battery's own options a check takes
DTYPES_HELP = (
    "Comma-separated precisions: fp32, bf16, fp16 (llamacpp: KV-cache types, also q8_0). "
    f"Default: a server's own; else for a battery (a backend with a prefix cache) the "
    f"precision its clean engine is measured exact at (fp32 on vLLM); else {USER_PRECISION}."
)


@dataclass(frozen=True, kw_only=True)
class CheckRequest(RunOptions):
    """What ``kvreplay check`` was asked: the shared run options, what must hold, and
    where the verdict goes; ``own`` holds the options given of the experiment it runs
    (``--select``, ``--screen``) or of the trainer gate (its bounds and the rollout
    options it takes)."""

    # the shared --dtypes, with the check's own default: None until run_check chooses
    dtypes: tuple[str, ...] | None = field(  # type: ignore[assignment]
        default=None, metadata=RunOptions.__dataclass_fields__["dtypes"].metadata
    )
    out: Path | None = field(
        default=None,
        metadata=option(
            "--out",
            "Run folder of the check (default: kvreplay-check/<model>-<backend>-<dtypes>-"
            "t<temperature>); rerunning resumes it, and kvreplay audit re-executes it.",
            output="folder",
        ),
    )
    expect: str | None = field(
        default=None,
        metadata=option(
            "--expect",
            "What must hold: exact (every suffix equal: the token level; the default when "
            "greedy), max-divergent (at most --max-divergent items differ), bitwise (every "
            "compared step's numerics bit-equal: logits or top-k logprobs, and K/V where the "
            "backend has them; stops at the first item whose numerics part; what a gate on a "
            "deterministic mode such as VLLM_BATCH_INVARIANT=1 wants), or faithful (the "
            "seeded samples' certificate within --margin; the default at --temperature > 0). "
            "Every verdict reports both levels.",
            choices=EXPECTATIONS,
        ),
    )
    max_divergent: int | None = field(
        default=None,
        metadata=option(
            "--max-divergent",
            "Items allowed to diverge under --expect max-divergent.",
            minimum=0,
            maximum=COUNTS[1],
        ),
    )
    max_rate: float | None = field(
        default=None,
        metadata=option(
            "--max-rate",
            "Run as many items as a pass needs to bound the divergence rate under this rate "
            "at 95% (e.g. 0.05: 72 items), stopping as soon as the bound is out of reach; "
            "replaces --n.",
            minimum=0,
            maximum=1,
        ),
    )
    margin: float | None = field(
        default=None,
        metadata=option(
            "--margin",
            f"Equivalence margin of --expect faithful, in (0, 1) (default {DEFAULT_MARGIN:g}).",
            minimum=0,
            maximum=1,
        ),
    )
    samples: int | None = field(
        default=None,
        metadata=option(
            "--samples",
            f"Seeded samples per item at --temperature > 0 (default {DEFAULT_SAMPLES}).",
            minimum=2,
            maximum=4096,
        ),
    )
    json_path: Path | None = field(
        default=None,
        metadata=option("--json", f"Write the verdict as JSON (schema {SCHEMA}).", output="file"),
    )
    junit_path: Path | None = field(
        default=None,
        metadata=option("--junit", "Write JUnit XML: one test case per item.", output="file"),
    )
    repro: Path | None = field(
        default=None,
        metadata=option(
            "--repro",
            "Repro pack of the first divergent item (default: <out>.repro).",
            output="folder",
        ),
    )
    trainer: str | None = field(
        default=None,
        metadata=option(
            "--trainer",
            "Gate the training-inference mismatch instead: the backend under test samples "
            "rollouts, this scorer (BACKEND:PRECISION[:SCHEDULE][@MODEL], e.g. hf:fp32, or "
            "engine:replay) teacher-forces them; see docs/experiments/rollout.md.",
        ),
    )
    update: str | None = field(
        default=None,
        metadata=option(
            "--update",
            "Gate a weight update instead: the backend under test is updated to these "
            "weights mid-run through its own path (perturb:SCALE[:SEED], or a model folder "
            "of the same architecture and tokenizer), and a prompt cached before the update "
            "must be served after it as a miss, bit for bit (the stale-cache bug); see "
            "docs/experiments/weight-update.md.",
        ),
    )
    verbose: bool = field(
        default=False,
        metadata=option(
            "--verbose",
            "Show the engine's own log here instead of writing it to the run folder's engine.log.",
        ),
    )
    own: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)

    def words(self) -> list[str]:
        """The command-line words that ask for this check (after ``kvreplay check``)."""
        backend = self.backend
        chosen = ["--backend", backend.name] if backend.name != DEFAULT_BACKEND else []
        own = check_own_options()
        given = [w for key, value in self.own.items() for w in own[key].words(value)]
        return [*arguments(self), *chosen, *arguments(backend), *given]

    def rerun(self, items: Path, out: Path, precision: str) -> list[str]:
        """This check's command, narrowed to one item and precision and a new folder (no
        outputs, no selection): what a repro pack gives back."""
        narrowed = replace(
            self,
            items=str(items),
            n=1,
            dtypes=(precision,),
            out=out,
            max_rate=None,
            json_path=None,
            junit_path=None,
            repro=None,
            verbose=False,
            own={},
        )
        return ["kvreplay", "check", *narrowed.words()]


def run_check(request: CheckRequest, echo: Callable[[str], None]) -> Judged:
    """Run (or resume) the check asked for, print its verdict, write its outputs, and
    return the verdict. Every refusal comes before the run writes. The run stops once its
    verdict is decided (:func:`~kvreplay.verify.verdict.decided`)."""
    from kvreplay.experiments import get_experiment
    from kvreplay.run.runner import run

    role = _role(request)
    if role is not None:  # a gate of an experiment's own: the mismatch, a weight update
        return _run_gate_check(request, *role, echo)
    _refuse_gate_options(request)
    temperature = request.sampler.temperature
    expectation = parse_expectation(
        request.expect, request.max_divergent, request.margin, temperature, request.max_rate
    )
    name, extra = _experiment(request, expectation)
    if name == BATTERY:
        request = replace(request, backend=request.backend.for_battery())
    request = replace(request, dtypes=precisions(request, name))
    n = _item_count(request, expectation, BATTERY_ITEMS if name == BATTERY else DEFAULT_ITEMS)
    out = request.out or default_out(request)
    repro = request.repro or out.with_name(out.name + ".repro")
    reads = (request.items, request.model, request.plan)
    check_outputs(out, reads, request.json_path, request.junit_path, repro, request.verbose)
    shared = {f.name: getattr(request, f.name) for f in fields(RunOptions)}
    run_request = RunRequest(
        **shared | {"n": n}, experiment=name, out=out, extra=extra, command=request.command
    )
    _check_numerics(run_request.backend, expectation)
    experiment = get_experiment(name, run_request.backend, require_engine=False)
    with engine_log(out, request.verbose):
        run(run_request, quiet=True, stop=StopRule(experiment, expectation))
    ledger = RunLedger.open_existing(out)
    records, _ = parse_rows(ledger.rows_path, ledger.contract_hash)
    rows = [r for r in records if r.experiment == name]
    planned = len(request.dtypes) * n
    environment = recorded_environment(ledger.manifest)
    fault = ledger.manifest.get(FIELD)
    verdict = judge(experiment, rows, expectation, environment, planned, fault)
    judged = Judged(verdict, sentence(verdict), screen(verdict), to_json(verdict), junit(verdict))
    echo(judged.screen)
    write_outputs((judged.json, judged.junit), request.json_path, request.junit_path)
    pack = repro_pack(repro, verdict, out, rows, experiment, request.rerun)
    if pack is not None:
        echo(f"repro pack: {pack.folder}; reproduce the first divergence with: {pack.command}")
    echo(run_line(out, request.verbose))
    return judged


# A live vs prefill check's own options, refused beside a gate's role.
PREFILL_ONLY = ("max_divergent", "margin", "samples", "max_rate", "repro")
ROLES = ("trainer", "update")
"""The check roles an experiment's own gate judges, each named by a CheckRequest field."""


def role_gate(role: str) -> tuple[str, Gate]:
    """The experiment that serves a role and its gate, by its declaration."""
    name = check_experiment(role)
    where = declared()[name].gate
    assert where is not None, f"experiment {name} serves the {role} role without a gate"
    gate: Gate = load(where)
    return name, gate


def _gate_options(role: str) -> set[str]:
    _, gate = role_gate(role)
    own = declared_options(load(gate.options)) if gate.options else {}
    return {*own, *gate.takes}


def _role(request: CheckRequest) -> tuple[str, str] | None:
    """The role a check's options ask for and its spec (None: live vs prefill)."""
    given = [(role, getattr(request, role)) for role in ROLES if getattr(request, role)]
    if len(given) > 1:
        raise KvreplayError(f"--{given[0][0]} and --{given[1][0]} ask for two checks; give one.")
    return given[0] if given else None


def _run_gate_check(
    request: CheckRequest, role: str, spec: str, echo: Callable[[str], None]
) -> Judged:
    """``kvreplay check --ROLE SPEC``: run (or resume) the small run the role's gate asks
    for, in its own folder, and have the gate judge its rows; every refusal comes before
    the run writes."""
    from kvreplay.run.runner import run

    specs = declared_options(type(request))
    for key in PREFILL_ONLY:
        if getattr(request, key) not in (None, False):
            raise KvreplayError(
                f"{specs[key].flag} applies to the live vs prefill check, not to --{role}."
            )
    other = sorted(set(request.own) - _gate_options(role))
    if other or request.backend.traffic_clients:
        flag = "--traffic" if not other else check_own_options()[other[0]].flag
        raise KvreplayError(f"{flag} does not apply to a --{role} check.")
    name, gate = role_gate(role)
    asked = GateRequest(role, spec, request.expect, dict(request.own))
    planned = gate.plan(asked)
    base = default_out(request)
    out = request.out or base.with_name(base.name + planned.suffix)
    reads = (request.items, request.model, request.plan, *planned.reads)
    check_outputs(out, reads, request.json_path, request.junit_path, verbose=request.verbose)
    shared = {f.name: getattr(request, f.name) for f in fields(RunOptions)}
    n = request.n if request.n is not None else DEFAULT_ITEMS
    run_request = RunRequest(
        **shared | {"n": n}, experiment=name, out=out, extra=planned.options,
        command=request.command,
    )  # fmt: skip
    with engine_log(out, request.verbose):
        run(run_request, quiet=True)
    ledger = RunLedger.open_existing(out)
    records, _ = parse_rows(ledger.rows_path, ledger.contract_hash)
    config = ledger.manifest["experiments"][name]["config"]
    environment = recorded_environment(ledger.manifest)
    judged = gate.judge(asked, records, config, request.backend.name, environment)
    echo(judged.screen)
    write_outputs((judged.json, judged.junit), request.json_path, request.junit_path)
    echo(run_line(out, request.verbose))
    return judged


def _refuse_gate_options(request: CheckRequest) -> None:
    """A gate's own options given to a live vs prefill check are refused."""
    greedy = set(declared()[check_experiment("greedy")].option_fields())
    for role in ROLES:
        taken = sorted((set(request.own) & _gate_options(role)) - greedy)
        if taken:
            flag = check_own_options()[taken[0]].flag
            raise KvreplayError(f"{flag} applies to a --{role} check; give --{role} too.")


def _experiment(request: CheckRequest, expectation: Expectation) -> tuple[str, dict[str, Any]]:
    """The experiment the check runs (by its declared check role) and its own options."""
    faithful = expectation.kind == "faithful"
    if request.samples is not None and not faithful:
        raise KvreplayError("--samples applies at --temperature above 0 only.")
    traffic = request.backend.traffic_clients
    if traffic and faithful:
        raise KvreplayError("--traffic applies to greedy checks only.")
    if faithful and request.own:
        raise KvreplayError("--select and --screen apply to greedy checks only.")
    if faithful:
        samples = request.samples or DEFAULT_SAMPLES
        return check_experiment("faithful"), {"samples": samples, "margin": expectation.margin}
    if traffic:
        return check_experiment("traffic"), dict(request.own)
    battery = {k: v for k, v in request.own.items() if k in BATTERY_TAKES}
    greedy = {k: v for k, v in request.own.items() if k not in BATTERY_TAKES}
    if battery and greedy:
        raise KvreplayError("--shapes and --select or --screen belong to different checks.")
    if greedy or not request.backend.capabilities.cache_control:
        if battery:
            raise KvreplayError(
                f"--shapes needs a backend with a prefix cache; the {request.backend.name} "
                "backend has none."
            )
        return check_experiment("greedy"), greedy
    level = {"bitwise": "bits", "exact": "tokens"}.get(request.expect or "", "measured")
    return check_experiment("gate"), {**battery, "level": level, "stop_at_first": True}


def precisions(request: CheckRequest, experiment: str) -> tuple[str, ...]:
    """The precisions a check compares at: ``--dtypes``, else a server's own, else the
    battery's (where its clean engine is measured exact: vLLM's fp32), else the user's."""
    if request.dtypes:
        return request.dtypes
    probe = getattr(request.backend, "probe", None)
    served = probe.identity["settings"].get("dtype") if probe is not None else None
    if served is not None or experiment != BATTERY:
        return (served or USER_PRECISION,)
    from kvreplay.experiments.battery.experiment import MEASURED, engine_of

    measured = [p for e, p in MEASURED if e == engine_of(request.backend)]
    return (measured[0] if measured else USER_PRECISION,)


def default_out(request: RunOptions) -> Path:
    """One folder per model, backend, precisions and temperature, so a rerun resumes."""
    model = Path(request.model).name or "model"
    dtypes = "-".join(request.dtypes)
    name = f"{model}-{request.backend.name}-{dtypes}-t{request.sampler.temperature:g}"
    return Path("kvreplay-check") / re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def check_own_options() -> dict[str, Declared]:
    """The options of the experiments a check runs that it takes: the greedy one's
    (``--select``, ``--screen``), the battery's (``--shapes``), and each role gate's own
    (the trainer's bounds) with the options of its experiment that it takes."""
    found = dict(declared()[check_experiment("greedy")].option_fields())
    battery = declared()[BATTERY].option_fields()
    found |= {key: battery[key] for key in BATTERY_TAKES}
    for role in ROLES:
        name, gate = role_gate(role)
        own = declared()[name].option_fields()
        found |= {k: v for k, v in own.items() if k in gate.takes}
        found |= declared_options(load(gate.options)) if gate.options else {}
    return found


def _item_count(request: CheckRequest, expectation: Expectation, default: int) -> int:
    """How many items the check runs: ``--n`` (``default`` if not given), or under
    ``--max-rate`` as many as a pass needs to bound the rate under it, which the item set
    must hold."""
    from kvreplay.core.items import load_items

    needed = expectation.items_needed()
    if needed is None:
        return request.n if request.n is not None else default
    if request.n is not None:
        raise KvreplayError(
            f"--max-rate {expectation.max_rate:g} sets how many items run ({needed}); "
            "leave out --n."
        )
    total = len(load_items(request.items))
    if total < needed:
        raise KvreplayError(
            f"--max-rate {expectation.max_rate:g} needs {needed} items for a pass to bound "
            f"the divergence rate under it, but the item set {request.items} holds "
            f"{total}; give a larger --items set or a higher --max-rate."
        )
    return needed


def _check_numerics(backend: Any, expectation: Expectation) -> None:
    """A bitwise check compares numerics, which a backend reports through its logits
    (K/V access) or its top-k logprobs; one that reports neither is refused."""
    capabilities = backend.capabilities
    if expectation.kind == "bitwise" and not (capabilities.kv_access or capabilities.top_logprobs):
        raise KvreplayError(
            f"--expect bitwise compares numerics, but the {backend.name} backend reports "
            "neither logits nor top-k logprobs; use --expect exact."
        )


__all__ = [
    "BATTERY_ITEMS",
    "CHECK_DEFAULTS",
    "DEFAULT_ITEMS",
    "SCHEMA",
    "CheckRequest",
    "run_check",
]
