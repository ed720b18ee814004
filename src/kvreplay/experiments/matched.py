"""``matched``: per item and precision, the retained live state vs a one-shot prefill of
the same prefix, each with a replica (``matched_live_prefill.csv``)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from kvreplay.comparison import first_divergence
from kvreplay.experiments.columns import Column, Line
from kvreplay.experiments.experiment import Experiment, planned_keys
from kvreplay.experiments.matrix import matrix_columns, matrix_panel, run_matrix
from kvreplay.experiments.rows import ArmResult
from kvreplay.experiments.scope import Scope, Selection
from kvreplay.experiments.served import ServedArm, ServedPanel, run_served_panel
from kvreplay.experiments.units import Clock, Unit, UnitKey, Workbench
from kvreplay.items import Item
from kvreplay.ledger import Record

MATCHED = "matched"


class Matched(Experiment):
    name = MATCHED
    csv_file = "matched_live_prefill.csv"
    panel = matrix_panel("live")
    table = matrix_columns("live", paper_l2=False)

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {"dtypes": list(scope.dtypes), "item_ids": [item.id for item in selection.items]}

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype)
            for dtype in scope.dtypes
            for item in selection.items
        ]

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        row = run_matrix(worker, unit, clock, self.panel)
        return {"item_id": unit.item.id, "precision": unit.precision, **row}

    def lines(self, rows: list[Record]) -> list[Line]:
        """Rows of items that reached the boundary at every precision.

        Live generation may reach the boundary at one precision and not another; the
        paper's ledger pairs precisions row by row, so such items stay in rows.jsonl and
        in the run summary (as unreached) but not in the CSV.
        """
        precisions = {r.data["precision"] for r in rows}
        reached: dict[str, set[str]] = {}
        for r in rows:
            if r.data["status"] == "ok":
                reached.setdefault(r.data["item_id"], set()).add(r.data["precision"])
        complete = {item for item, seen in reached.items() if seen == precisions}
        return [
            Line(self.read_row(r.data), r.row_sha256) for r in rows if r.data["item_id"] in complete
        ]


def first_token_logprob_diff(left: ArmResult, right: ArmResult) -> float | None:
    """|logprob| difference of the left arm's first token between the two arms, where
    both engines listed it among their top logprobs."""
    assert left.served is not None and right.served is not None
    lefts = {t: lp for t, lp in left.served.first_logprobs}
    rights = {t: lp for t, lp in right.served.first_logprobs}
    token = left.boundary_argmax
    if token not in lefts or token not in rights:
        return None
    return abs(lefts[token] - rights[token])


def _cached(arm: str) -> Any:
    return lambda x: x.row.arms[arm].served.cached_tokens[0]


def _equal(arm: str, other: str) -> Any:
    """Suffixes equal; empty where the arm did not run or followed another P."""

    def get(x: Line) -> bool | None:
        arms = x.row.arms
        if arm not in arms or arms[arm].served.prefix_reproduced is False:
            return None
        return arms[arm].suffix_sha256 == arms[other].suffix_sha256

    return get


def _sha(arm: str) -> Any:
    return lambda x: x.row.arms[arm].suffix_sha256 if arm in x.row.arms else None


def served_columns() -> list[Column[Line]]:
    """The columns a served row adds to a matrix ledger in place of the K/V columns it
    leaves empty: engine-reported cached tokens and logprob-based measures."""

    def divergence(x: Line) -> int | None:
        return first_divergence(x.row.left.suffix_token_ids, x.row.right.suffix_token_ids)

    return [
        Column("backend", lambda x: x.row.fields["backend"]),
        Column("live_cached_tokens", _cached("left")),
        Column("prefill_cached_tokens", _cached("prefill")),
        Column("first_token_logprob_diff",
               lambda x: first_token_logprob_diff(x.row.left, x.row.right)),
        Column("live_margin_at_divergence", lambda x: x.row.left.margin_at(divergence(x))),
        Column("prefill_margin_at_divergence", lambda x: x.row.right.margin_at(divergence(x))),
        Column("uninterrupted_suffix_sha256", _sha("uninterrupted")),
        Column("uninterrupted_equal_live", _equal("uninterrupted", "left")),
        Column("uninterrupted_equal_prefill", _equal("uninterrupted", "prefill")),
        Column("batched_suffix_sha256", _sha("batched")),
        Column("batched_equal_live", _equal("batched", "left")),
        Column("batch_companions", lambda x: json.dumps(
            x.row.arms["batched"].served.companions) if "batched" in x.row.arms else None),
    ]  # fmt: skip


class ServedMatched(Matched):
    """``matched`` on a serving backend: a prefix-cache hit vs a miss of the same P, each
    with a replica under the same cache condition, beside the uninterrupted request and
    the hit co-scheduled with companions (see :mod:`kvreplay.experiments.served`). Its
    rows fill the matched ledger's columns where they apply and leave the K/V ones empty."""

    panel = ServedPanel(  # type: ignore[assignment]
        (
            ServedArm("left", "hit"),
            ServedArm("prefill", "miss"),
            ServedArm("uninterrupted", "uninterrupted", replica=False),
            ServedArm("batched", "hit", replica=False, companions=True),
        )
    )
    table = matrix_columns("live", paper_l2=False) + served_columns()

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        """Each unit names its companions (:meth:`derived_inputs`)."""
        items = {item.id: item for item in selection.items}
        derived = self.derived_inputs(self.config(scope, selection), scope.config, items)
        return [
            replace(unit, inputs=derived[str(unit.key)])
            for unit in super().units(phase, scope, selection, rows)
        ]

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """The next items of the selection, in turn, as each unit's companions."""
        selected = [items[i] for i in config["item_ids"]]
        k = min(run.backend.companions, len(selected) - 1)
        return {
            str(UnitKey(self.name, item.id, dtype)): {"companions": companions(selected, i, k)}
            for dtype in config["dtypes"]
            for i, item in enumerate(selected)
        }

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        row, prefix = run_served_panel(worker, unit, clock, self.panel)
        if row is None:
            return {"item_id": unit.item.id, "precision": unit.precision, "status": "unreached",
                    **prefix}  # fmt: skip
        row.fields |= {
            "left_construction": self.panel.arms[0].construction,
            "labels": row.labels.to_dict(),
        }
        return row.to_dict()


def companions(items: list[Item], index: int, k: int) -> list[dict[str, Any]]:
    """The ``k`` items after ``index``, wrapping around, as plain data for the unit."""
    mates = [items[(index + step) % len(items)] for step in range(1, k + 1)]
    return [{"item_id": item.id, "prompt": item.prompt} for item in mates]
