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
from kvreplay.core.planted import FIELD
from kvreplay.experiments.battery.table import BATTERY
from kvreplay.experiments.registry import check_experiment, declared
from kvreplay.ledger import RunLedger, parse_rows
from kvreplay.run.enginelog import engine_log, run_line
from kvreplay.run.outputs import check_outputs, recorded_environment, write_outputs
from kvreplay.run.repro import repro_pack
from kvreplay.run.request import RunOptions, RunRequest
from kvreplay.verify.expectation import DEFAULT_MARGIN, EXPECTATIONS, Expectation, parse_expectation
from kvreplay.verify.mismatch import MismatchBounds
from kvreplay.verify.render import SCHEMA, junit, screen, to_json
from kvreplay.verify.verdict import StopRule, Verdict, judge

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
    (``--select``, ``--screen``; a ``--trainer`` check's rollout options)."""

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
    verbose: bool = field(
        default=False,
        metadata=option(
            "--verbose",
            "Show the engine's own log here instead of writing it to the run folder's engine.log.",
        ),
    )
    bounds: MismatchBounds = field(default_factory=MismatchBounds)
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


def run_check(request: CheckRequest, echo: Callable[[str], None]) -> Verdict:
    """Run (or resume) the check asked for, print its verdict, write its outputs, and
    return the verdict. Every refusal comes before the run writes. The run stops once its
    verdict is decided (:func:`~kvreplay.verify.verdict.decided`)."""
    from kvreplay.experiments import get_experiment
    from kvreplay.run.mismatch_check import refuse_without_trainer, run_mismatch_check
    from kvreplay.run.runner import run

    if request.trainer is not None:  # a gate on the training-inference mismatch
        request = replace(request, dtypes=request.dtypes or (USER_PRECISION,))
        return run_mismatch_check(request, echo, (DEFAULT_ITEMS, default_out(request)))  # type: ignore[return-value]
    refuse_without_trainer(request)
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
    echo(screen(verdict))
    write_outputs((to_json(verdict), junit(verdict)), request.json_path, request.junit_path)
    pack = repro_pack(repro, verdict, out, rows, experiment, request.rerun)
    if pack is not None:
        echo(f"repro pack: {pack.folder}; reproduce the first divergence with: {pack.command}")
    echo(run_line(out, request.verbose))
    return verdict


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
    (``--select``, ``--screen``) and the rollout options a ``--trainer`` check takes."""
    from kvreplay.run.mismatch_check import ROLLOUT, TAKEN

    greedy = declared()[check_experiment("greedy")].option_fields()
    battery = declared()[BATTERY].option_fields()
    rollout = declared()[ROLLOUT].option_fields()
    return {
        **greedy,
        **{key: battery[key] for key in BATTERY_TAKES},
        **{key: rollout[key] for key in TAKEN},
    }


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
