"""Fragile-first selection (design: check): a stack that diverges rarely is caught soonest
by the items whose live trajectory passes nearest a tie, since a rebuilt prefix can only
change a suffix where its numerics move enough to swap a greedy argmax.

``matched --select fragile --screen M`` screens the first M items of the set: each
candidate's screen row is its prefix row (kind ``prefix``) that also records the
top-1/top-2 margins of the first :data:`WINDOW` decoded suffix steps of its live
continuation. That is one live generation cut short, a fraction of a matched row's arms.
The rows then run for the ``--n`` candidates whose screen is riskiest, riskiest first
(the flip predictor's primary score, :data:`kvreplay.analysis.flip.PRIMARY_SCORE`), so a
check that stops at its first divergence stops soonest. The ranking is a pure function of
the recorded screen rows, so an audit re-derives it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import COUNTS, option
from kvreplay.core.stages import StagePlan
from kvreplay.core.trajectory import Trajectory
from kvreplay.harness.prefixes import prefix_record, prompt_ids
from kvreplay.harness.scope import Scope, own_options
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

WINDOW = 32  # decoded suffix steps a screen reads: the flip predictor's window
SELECTIONS = ("first", "fragile")
DEFAULT_SCREEN = 16  # candidates: most of the catch a larger pool gives (BENCHMARKS.md)


@dataclass(frozen=True)
class MatchedOptions:
    """``matched``'s own options: which items run (the first ``--n``, or the ``--n``
    most fragile of ``screen`` screened candidates)."""

    select: str = field(
        default="first",
        metadata=option(
            "--select",
            "Which items run: the first --n, or the --n most fragile of --screen screened "
            "candidates (nearest a tie along their live trajectory), riskiest first.",
            choices=SELECTIONS,
        ),
    )
    screen: int | None = field(
        default=None,
        metadata=option(
            "--screen",
            f"Candidates --select fragile screens (the first of the item set; default "
            f"{DEFAULT_SCREEN}, or --n if larger); each costs one short live generation.",
            minimum=1,
            maximum=COUNTS[1],
        ),
    )

    @classmethod
    def of(cls, scope: Scope) -> MatchedOptions:
        options = own_options(cls, scope, "matched's")
        if options.select not in SELECTIONS:
            raise KvreplayError(
                f"Unknown selection {options.select!r}; choose {', '.join(SELECTIONS)}."
            )
        if options.screen is not None and options.select != "fragile":
            raise KvreplayError("--screen applies to --select fragile only.")
        return options

    def candidates(self, n: int, total: int) -> int:
        """How many items are screened for ``n`` rows, within a set of ``total``."""
        screen = self.screen if self.screen is not None else max(DEFAULT_SCREEN, n)
        if not n <= screen <= total:
            raise KvreplayError(
                f"--screen must be from --n ({n}) to the {total} items of the set; got {screen}."
            )
        return screen


def screen_plan(plan: StagePlan, window: int = WINDOW) -> StagePlan:
    """The plan with its suffix stages cut so that they decode at most ``window`` tokens."""
    left, stages = window, list(plan.stages)
    for index in range(plan.boundary + 1, len(stages)):
        cap = min(stages[index].max_new_tokens, left)
        if cap == 0:
            return replace(plan, stages=tuple(stages[:index]))
        stages[index] = replace(stages[index], max_new_tokens=cap)
        left -= cap
    return replace(plan, stages=tuple(stages))


def screen_row(worker: Workbench, unit: Unit, clock: Clock, served: bool) -> dict[str, Any]:
    """A candidate's screen: its live prefix and the margins of its first decoded suffix
    steps, generated in process (``served`` False) or through the serving engine."""
    config = worker.config
    plan, sampler = config.plan, config.sampler
    suffix: Trajectory | None = None
    if served:
        from kvreplay.harness.served import generate_prefix, serve_stages

        engine = worker.served(unit.precision)
        with clock.model():
            engine.reset_cache()
            prefix = generate_prefix(engine, prompt_ids(worker, engine, unit.item), plan, sampler)
            segments = []
            if prefix.reached:
                segments, _ = serve_stages(
                    engine, prefix.token_ids, screen_plan(plan).suffix_stages, sampler, True
                )
        suffix = Trajectory(segments)
    else:
        from kvreplay.model.construct import live  # in process only: loads torch
        from kvreplay.model.decode import continue_from

        lm = worker.model(unit.precision)
        with clock.model():
            state, prefix = live(lm, prompt_ids(worker, lm, unit.item), plan, sampler)
            if prefix.reached:
                suffix = continue_from(lm, state, screen_plan(plan), sampler)
    margins = [m for s in suffix.segments for m in s.margins] if suffix else []
    return {
        "item_id": unit.item.id,
        "precision": unit.precision,
        "kind": "prefix",
        "status": "ok" if prefix.reached else "unreached",
        "source": {"key": str(unit.key), "generated": True},
        **prefix_record(prefix),
        "screen_margins": [round(m, 6) for m in margins[:WINDOW]],
    }


def risk(margins: list[float]) -> float:
    """Minus the smallest margin: a near-tie anywhere in the window makes a row risky."""
    return -min(margins) if margins else -math.inf


def ranked(experiment: str, candidates: list[str], rows: Mapping[str, Record], n: int) -> list[str]:
    """The ``n`` reached candidates whose screens are riskiest, riskiest first (equal risks
    in candidate order); empty until every candidate's screen row is recorded."""
    screens = [rows.get(str(UnitKey.prefix(experiment, item))) for item in candidates]
    if None in screens:
        return []
    reached = [
        (risk(r.data.get("screen_margins", [])), position, r.data["item_id"])
        for position, r in enumerate(s for s in screens if s is not None)
        if r.data["status"] == "ok"
    ]
    return [item for _, _, item in sorted(reached, key=lambda x: (-x[0], x[1]))[:n]]
