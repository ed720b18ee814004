"""``localize``: which layers, and keys or values, carry a divergent trajectory
(``localize.csv``, ``figures/localize.png``).

On each divergent row of a prior run (fixed-prefix, matched or transplant) one replay
and one prefill state are built; the native arms are continued with replicas as in the
matrix; then subsets of the donor's K/V (replay's, by default) are transplanted into the
recipient (prefill) and each probe is decoded against the donor's suffix:

- every single layer ``{i}``;
- growing prefixes ``[0, k)`` and suffixes ``[k, L)`` of the layer stack;
- keys only and values only, all layers (the full K/V transplant is ``[0, L)``);
- a bisection for a small sufficient contiguous window, when the full transplant
  recovers: start from ``[0, L)``; split the window at its midpoint; keep the lower half
  if it alone recovers the donor, else the upper half if it does, else stop. The result
  is a sufficient window neither half of which suffices on its own; the order of tries
  is fixed, so the bisection is deterministic (at most 2·log2 L probes, most of them
  already decoded by the sweeps and reused).

A probe is decoded only while it reproduces the donor's suffix (see :func:`follow`):
greedy decoding that has matched every earlier token is the same computation as the
donor's until the first differing token, so recovery and the first divergence index are
exact, and a probe that leaves the donor stops there. ``suffix_sha256`` is therefore
the donor's suffix hash on recovering probes and empty on the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import StagePlan
from kvreplay.core.trajectory import Trajectory
from kvreplay.experiments.localize.section import draw, recovery
from kvreplay.experiments.localize.table import (
    DIRECTIONS,
    SWEEPS,
    Probe,
)
from kvreplay.experiments.registry import EXPERIMENTS, outcome_sources
from kvreplay.experiments.transplant.table import TRANSPLANT
from kvreplay.harness.blocks import engine_of, follow_in_engine
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Arm, Panel
from kvreplay.harness.prefixes import prefix_inputs
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.selection import PanelOptions, select_panel
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.backends.hf.loading import LoadedModel
    from kvreplay.model.state import BoundaryState, Component

# The probes below run in process only (they import torch when they run): the
# experiment itself is read without torch, for its table, report and verdicts.


def follow(
    lm: LoadedModel, state: BoundaryState, reference: Trajectory, sampler: Sampler
) -> int | None:
    """Continue ``state`` while it picks ``reference``'s tokens; return the index (in the
    suffix's token stream) of the first token it picks differently, or None if none.

    The first stage's opener is already in the prefix; later openers are teacher-forced,
    as :func:`kvreplay.model.decode.run_stages` does. Stops depend only on the tokens, so a
    state that matches every token would have stopped exactly where the reference did.
    """
    from kvreplay.model.decode import feed_each

    generator = sampler.generator()
    index = 0
    last_stage = len(reference.segments) - 1
    for number, segment in enumerate(reference.segments):
        if number > 0:
            feed_each(state, lm.model, segment.opener_ids)
        index += len(segment.opener_ids)
        for position, token in enumerate(segment.token_ids):
            assert state.logits is not None
            if sampler.pick(state.logits, generator) != token:
                return index
            index += 1
            if number < last_stage or position < len(segment.token_ids) - 1:
                state.advance(lm.model, [token])
    return None


class Prober:
    """Runs probes of one direction on one row, decoding each layer set only once."""

    def __init__(
        self,
        direction: str,
        decide: Callable[[tuple[int, ...], Component], int | None],
    ):
        self.direction = direction
        self.decide = decide
        self.seen: dict[tuple[tuple[int, ...], str], int | None] = {}
        self.probes: list[Probe] = []

    def __call__(self, sweep: str, layers: Sequence[int], component: Component = "kv") -> bool:
        key = (tuple(layers), component)
        if key not in self.seen:
            self.seen[key] = self.decide(key[0], component)
        divergence = self.seen[key]
        self.probes.append(
            Probe(self.direction, sweep, list(key[0]), component, divergence is None, divergence)
        )
        return divergence is None


def bisect(probe: Prober, num_layers: int) -> tuple[int, int] | None:
    """The module docstring's deterministic bisection; None if all layers do not suffice."""
    low, high = 0, num_layers
    if not probe("bisect", range(low, high)):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if probe("bisect", range(low, middle)):
            high = middle
        elif probe("bisect", range(middle, high)):
            low = middle
        else:
            break
    return low, high


def sweep(probe: Prober, num_layers: int) -> None:
    """Every probe of one direction, in a fixed order."""
    for layer in range(num_layers):
        probe("single", [layer])
    for count in range(1, num_layers + 1):
        probe("prefix", range(count))
    for start in range(num_layers):
        probe("suffix", range(start, num_layers))
    for component in ("k", "v"):
        probe("component", range(num_layers), component)
    window = bisect(probe, num_layers)
    if window is not None:
        probe("minimal", range(*window))


def _decide(
    lm: LoadedModel,
    plan: StagePlan,
    sampler: Sampler,
    clock: Clock,
    donor: BoundaryState,
    recipient: BoundaryState,
    reference: Trajectory,
    layers: tuple[int, ...],
    component: Component,
) -> int | None:
    """Transplant ``layers`` of ``component`` and follow the donor's suffix (in full, in
    an engine that holds the states)."""
    from kvreplay.model.state import transplant

    state = transplant(donor, recipient, layers, component)
    with clock.model():
        if engine_of(lm) is not None:
            return follow_in_engine(lm, state, reference, plan, sampler)
        return follow(lm, state, reference, sampler)


class Localize(Experiment):
    panel = Panel((Arm("left", "replay"), Arm("prefill", "prefill")), keep_states=True)

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        # a transplant panel's rows hold outcomes too
        sources = (*outcome_sources(), EXPERIMENTS.get(TRANSPLANT))
        return select_panel(self.name, "divergent", scope, rows, sources)

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        both = PanelOptions.of(scope).both_directions
        directions = DIRECTIONS if both else DIRECTIONS[:1]
        return {
            "precision": scope.dtypes[0],
            "directions": [name for name, _, _ in directions],
            "sweeps": list(SWEEPS),
            "selection": selection.rule,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        by_id = {item.id: item for item in selection.items}
        directions = self.config(scope, selection)["directions"]
        precision = scope.dtypes[0]
        units = []
        for entry in selection.rule["rows"]:
            source = scope.source_rows()[entry["source_key"]]
            inputs = {
                **prefix_inputs(source),
                "source": {"key": source.key, "row_sha256": source.row_sha256},
                "selection_index": entry["selection_index"],
                "directions": directions,
            }
            item = by_id[entry["item_id"]]
            units.append(Unit(UnitKey(self.name, item.id, precision), item, precision, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        ids = [entry["item_id"] for entry in config["selection"]["rows"]]
        return planned_keys(self.name, ids, [config["precision"]], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        from kvreplay.harness.executor import run_panel  # in process only: loads torch

        result = run_panel(worker, unit, clock, self.panel)
        row, lm = result.row, result.lm
        assert row is not None and row.comparison is not None, "a recorded prefix is reached"
        probes: list[Probe] = []
        if row.diverges:
            for name, donor, recipient in DIRECTIONS:
                if name not in unit.inputs["directions"]:
                    continue
                decide = functools.partial(
                    _decide,
                    lm,
                    worker.config.plan,
                    worker.config.sampler,
                    clock,
                    result.states[donor],
                    result.states[recipient],
                    row.arms[donor].suffix,
                )
                prober = Prober(name, decide)
                sweep(prober, lm.num_layers)
                probes += prober.probes
        row.fields = {
            "left_construction": "replay",
            "num_layers": lm.num_layers,
            "source": unit.inputs["source"],
            "labels": row.labels.to_dict(),
            "boundary_argmax_equal": row.comparison.boundary_argmax_equal,
            "divergent": row.diverges,
            "probes": [asdict(p) for p in probes],
        }
        row.comparison = None  # a localize row keeps only the boundary argmax verdict
        return row.to_dict()

    def figures(self, run_dir: Path, rows: Iterable[Record]) -> list[Path]:
        """Recovery rate by layer set and component, one line per direction: the report's
        localize figure (experiments/localize/section.py), drawn after each run."""
        from kvreplay.render.figures import Figures  # matplotlib loads only to draw

        probed = [row for row in rows if row.data.get("probes")]
        directions = recovery(self.table.ledger(probed, {})).directions if probed else {}
        return [draw(directions, Figures(run_dir / "figures"))]
