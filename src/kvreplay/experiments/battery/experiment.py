"""``battery``: does a prefix-cache hit continue exactly as a miss of the same prompt,
whatever history wrote the blocks it reads? (``battery_shapes.csv``; design: request
shape, battery, comparison level.)

Per item and precision, on a serving engine with prefix caching (in process or over
HTTP), P is the item's prompt. The row first serves P's miss twice (a reset cache, one
prefill: the calibration replica, which must agree bit for bit, or the stack is not
deterministic), then runs each request shape of :mod:`kvreplay.experiments.battery.shapes`
in turn: a reference miss and the hit after the shape's history, both recorded as arms
of the row, so that the audit re-executes and re-derives them like any served panel.

Each shape is compared at its **level**: bit for bit at the engine's reported top-k
log-probabilities where the clean engine is measured exact on this stack
(:data:`MEASURED`), at tokens elsewhere and for the batched shape (a batch of two moves
a clean engine's numerics); ``--level bits`` or ``tokens`` compares every shape there.
``--stop-at-first`` ends an item's shapes at the first that parts hit from miss (what a
check runs: a failing check stops at the first detection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvreplay.core.canonical import sha256_json, sha256_tokens
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.core.options import option
from kvreplay.core.scoring import score
from kvreplay.core.trajectory import Trajectory
from kvreplay.experiments.battery.outcome import (
    CALIBRATION,
    CHOSEN_LEVELS,
    FIELD,
    Level,
    ShapeOutcome,
    live_arm,
    miss_arm,
)
from kvreplay.experiments.battery.shapes import SHAPES, Lab, ShapeRun
from kvreplay.harness.experiment import Experiment, derived_units, planned_keys
from kvreplay.harness.panel import Panel
from kvreplay.harness.prefixes import prompt_ids
from kvreplay.harness.rows import ArmResult, PanelRow, ReplicaGate, ServedReport, replica_name
from kvreplay.harness.scope import Scope, Selection, own_options
from kvreplay.harness.served import ServedArm
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.backends.base import Backend
    from kvreplay.backends.served import Reply, ServedModel


MEASURED: dict[tuple[str, str], str] = {
    ("vllm", "fp32"): "vLLM's CPU engine, whose clean hit and miss agree bit for bit there "
    "in every unbatched shape (docs/benchmarks/faults.md)",
}
"""The stacks (engine, precision) where a clean engine's hit and miss were measured
bit-equal at the reported log-probabilities: there a battery compares at ``bits``.
Elsewhere it compares tokens, and says so."""


@dataclass(frozen=True)
class BatteryOptions:
    """``battery``'s own options (``kvreplay check`` takes ``--shapes``, sets the level
    from ``--expect`` and always stops at the first detection)."""

    shapes: str = field(
        default=",".join(SHAPES),
        metadata=option(
            "--shapes",
            f"Comma-separated request shapes, run in the order given ({', '.join(SHAPES)}).",
        ),
    )
    level: str = field(
        default="measured",
        metadata=option(
            "--level",
            "Where each shape's hit is compared with its miss: measured (bit for bit at the "
            "reported log-probabilities where the clean engine is measured exact on this "
            "stack, else tokens; the batched shape at tokens), bits, or tokens.",
            choices=CHOSEN_LEVELS,
        ),
    )
    stop_at_first: bool = field(
        default=False,
        metadata=option(
            "--stop-at-first", "End an item's shapes at the first that parts hit from miss."
        ),
    )

    @classmethod
    def of(cls, scope: Scope) -> BatteryOptions:
        options = own_options(cls, scope, "battery's")
        unknown = [s for s in options.names() if s not in SHAPES]
        if unknown or not options.names():
            raise KvreplayError(
                f"--shapes names {unknown[0] if unknown else 'no shape'}; "
                f"choose from {', '.join(SHAPES)}."
            )
        if options.level not in CHOSEN_LEVELS:
            raise KvreplayError(f"--level must be one of {', '.join(CHOSEN_LEVELS)}.")
        return options

    def names(self) -> list[str]:
        return [s.strip() for s in self.shapes.split(",") if s.strip()]


def engine_of(backend: Backend) -> str:
    """The engine behind a backend: a server's own name over HTTP, else the backend's."""
    return str(backend.contract().get("server", backend.name))


def stack_level(backend: Backend, precision: str) -> tuple[Level, str | None]:
    """The level a clean engine is measured exact at on this stack, and the measurement
    (None: not measured, so tokens)."""
    measured = MEASURED.get((engine_of(backend), precision))
    return ("bits", measured) if measured else ("tokens", None)


def shape_level(declared: Level, chosen: str, stack: Level) -> Level:
    """A shape's level: the one asked for, or the stack's where the shape's own allows."""
    if chosen != "measured":
        return chosen  # type: ignore[return-value]
    return "tokens" if "tokens" in (declared, stack) else "bits"


def typed_row(data: dict[str, Any]) -> PanelRow:
    """A battery row typed: its compared pair is its first shape that ran."""
    return PanelRow.from_dict(data, tuple(data[FIELD]["compared"]))  # type: ignore[arg-type]


class Battery(Experiment):
    """The request shapes against their misses, per item and precision, on a serving
    engine (see the module docstring)."""

    served = True
    panel = Panel((ServedArm("hit", "hit"), ServedArm("miss", "miss")))

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        backend = scope.config.backend
        if not backend.capabilities.cache_control:
            raise KvreplayError(
                f"battery serves prefix-cache hits and misses, which the {backend.name} "
                "backend cannot force; run it with --backend vllm or http."
            )
        options = BatteryOptions.of(scope)
        return {
            "dtypes": list(scope.dtypes),
            "item_ids": [item.id for item in selection.items],
            "shapes": options.names(),
            "level": options.level,
            "stop_at_first": options.stop_at_first,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        return derived_units(self, scope, selection)

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """Every unit runs the recorded shapes at the recorded level."""
        inputs = {k: config[k] for k in ("shapes", "level", "stop_at_first")}
        return {
            str(UnitKey(self.name, item, dtype)): dict(inputs)
            for dtype in config["dtypes"]
            for item in config["item_ids"]
        }

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def read_row(self, data: dict[str, Any]) -> PanelRow:
        return typed_row(data)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        config = worker.config
        served = worker.served(unit.precision)
        p = prompt_ids(worker, served, unit.item)
        stack, _ = stack_level(config.backend, unit.precision)
        lab = Lab(served, p, f"{config.sampler.seed}:{unit.item.id}", config.backend.expected_hit)
        bench = _Bench(worker, served, unit)
        with clock.model():
            first, again = lab.miss(p), lab.miss(p)
        lab.reference = first
        arms = {CALIBRATION: bench.arm(first, "cache-miss", len(p)),
                replica_name(CALIBRATION): bench.arm(again, "cache-miss", len(p))}  # fmt: skip
        shapes: list[dict[str, Any]] = []
        compared: list[str] | None = None
        for name in unit.inputs["shapes"]:
            with clock.model():
                run = SHAPES[name](lab)
            level = shape_level(run.level, unit.inputs["level"], stack)
            shapes.append({"shape": name, "level": level, "exercised": run.exercised,
                           "note": run.note})  # fmt: skip
            ran = bench.arms(run)
            arms |= ran
            compared = compared or ([name, miss_arm(name)] if ran else None)
            outcome = ShapeOutcome(name, level, run.exercised, run.note, ran.get(name),
                                   ran.get(miss_arm(name)), ran.get(live_arm(name)))  # fmt: skip
            if outcome.detected and unit.inputs["stop_at_first"]:
                break
        if compared is None:
            raise KvreplayError(f"No request shape could run on item {unit.item.id}.")
        row = PanelRow(
            item_id=unit.item.id,
            precision=unit.precision,
            prefix=_prompt_record(p),
            arms=arms,
            replicas={CALIBRATION: ReplicaGate.served([arms[CALIBRATION]],
                                                      [arms[replica_name(CALIBRATION)]])},
            comparison=None,
            functional_state_equal=None,
            all_storage_disjoint=None,
            compared=(compared[0], compared[1]),
            fields={"backend": config.backend.name,
                    FIELD: {"compared": compared, "shapes": shapes}},
        )  # fmt: skip
        return row.to_dict()


@dataclass(frozen=True)
class _Bench:
    """Turns a shape's replies into the row's arms, scored as any served arm is."""

    worker: Workbench
    served: ServedModel
    unit: Unit

    def arm(self, reply: Reply, construction: str, prompt: int, expected: int | None = None
            ) -> ArmResult:  # fmt: skip
        from kvreplay.backends.served import logprobs_fingerprint

        suffix = Trajectory([reply.segment])
        tokens = suffix.token_ids
        found = score(self.served.tokenizer, suffix, self.unit.item.answer,
                      self.worker.config.extractor)  # fmt: skip
        first = [[t, lp] for t, lp in reply.steps[0]] if reply.steps else []
        return ArmResult(
            construction=construction,
            cache_fingerprint=None,
            logits_fingerprint=logprobs_fingerprint(first),
            boundary_argmax=tokens[0] if tokens else -1,
            suffix=suffix,
            suffix_sha256=sha256_tokens(tokens),
            post_decode_cache_len=prompt + len(tokens) - 1,
            answer=found["extracted"],
            answer_parsed=found["parsed"],
            correct=found["correct"],
            served=ServedReport([reply.cached_tokens], first, expected_cached_tokens=expected),
        )

    def arms(self, run: ShapeRun) -> dict[str, ArmResult]:
        """A shape's hit, its miss and (``cut``) the live continuation at the cut."""
        if run.probe is None or run.reference is None:
            return {}
        name, prompt = run.shape, run.prompt_tokens
        found = {
            name: self.arm(run.probe, f"cache-hit-{name}", prompt, run.expected_cached_tokens),
            miss_arm(name): self.arm(run.reference, "cache-miss", prompt),
        }
        if run.live is not None:
            found[live_arm(name)] = self.arm(run.live, "live", prompt)
        return found


def _prompt_record(p: list[int]) -> dict[str, Any]:
    """P as a row records a prefix: here the item's prompt, no stage generated."""
    return {
        "prefix_token_ids": p,
        "prompt_token_count": len(p),
        "prefix_token_count": len(p),
        "prefix_sha256": sha256_json(p),
        "prefix_reached": True,
        "prefix_reason": "prompt",
        "prefix_stages": [],
    }
