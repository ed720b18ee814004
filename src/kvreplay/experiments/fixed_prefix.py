"""``fixed-prefix``: prefixes taken once (from this run's bf16 ``matched`` live rows, a
``--prefix-from`` run, or a fresh bf16 live generation), then held identical at every
precision: ``replay`` ("incremental") vs ``prefill`` (``fixed_prefix_2x2.csv``).

Phase 0 records one prefix row per item; phase 1 runs the matrix per item and precision.
"""

from __future__ import annotations

from typing import Any

from kvreplay.construct import live
from kvreplay.experiments.base import (
    Clock,
    Experiment,
    Scope,
    Selection,
    Unit,
    UnitKey,
    Workbench,
    planned_keys,
    prefix_record,
    prompt_ids,
)
from kvreplay.experiments.matched import MATCHED
from kvreplay.experiments.matrix import matrix_columns, matrix_csv_row, run_matrix
from kvreplay.experiments.panel import PREFIX_DTYPE
from kvreplay.items import Item
from kvreplay.ledger import Record
from kvreplay.state import sha256_tokens

PREFIX_FIELDS = (
    "prefix_token_ids",
    "prompt_token_count",
    "prefix_token_count",
    "prefix_sha256",
    "prefix_reached",
    "prefix_reason",
    "prefix_stages",
)


def _source_for(item: Item, dtype: str, rows: dict[str, Record]) -> Record | None:
    """A completed live row of ``matched`` for this item at ``dtype``, if any."""
    record = rows.get(str(UnitKey(MATCHED, item.id, dtype)))
    return record if record is not None and record.data.get("status") == "ok" else None


def prefix_inputs(record: Record) -> dict[str, Any]:
    """The recorded prefix of a row, as a later unit's inputs."""
    return {k: record.data[k] for k in PREFIX_FIELDS}


def trajectory_inputs(item: Item) -> dict[str, Any]:
    """The prefix of a trajectory item produced elsewhere (``prefix_token_ids``)."""
    assert item.prefix_token_ids is not None and item.prompt_token_count is not None
    ids = list(item.prefix_token_ids)
    return {
        "source": {"key": f"items.jsonl:{item.id}", "row_sha256": sha256_tokens(ids)},
        "prefix_token_ids": ids,
        "prompt_token_count": item.prompt_token_count,
        "prefix_token_count": len(ids),
        "prefix_sha256": sha256_tokens(ids),
        "prefix_reached": True,
        "prefix_reason": "",
        "prefix_stages": [],
    }


def prefix_unit(key: UnitKey, item: Item, dtype: str, source: Record | None) -> Unit:
    """A phase-0 unit that copies ``source``'s prefix or the item's own trajectory, or
    generates one live when there is neither."""
    inputs: dict[str, Any] = {}
    if source is not None:
        inputs = {
            "source": {"key": source.key, "row_sha256": source.row_sha256},
            **prefix_inputs(source),
        }
    elif item.prefix_token_ids is not None:
        inputs = trajectory_inputs(item)
    return Unit(key, item, dtype, inputs)


def prefix_row(worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
    """A prefix row: copied from the source the unit carries, or generated live."""
    base = {"item_id": unit.item.id, "precision": unit.precision, "kind": "prefix"}
    if "prefix_token_ids" in unit.inputs:
        return {**base, "status": "ok", **unit.inputs}
    lm = worker.model(unit.precision)
    with clock.model():
        _, prefix = live(
            lm, prompt_ids(worker, lm, unit.item), worker.config.plan, worker.config.sampler
        )
    return {
        **base,
        "status": "ok" if prefix.reached else "unreached",
        "source": {"key": str(unit.key), "generated": True},
        **prefix_record(prefix),
    }


class FixedPrefix(Experiment):
    name = "fixed-prefix"
    csv_file = "fixed_prefix_2x2.csv"
    columns = matrix_columns("incremental", paper_l2=True)
    phases = 2

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {
            "dtypes": list(scope.dtypes),
            "item_ids": [item.id for item in selection.items],
            "prefix_dtype": PREFIX_DTYPE,
            "prefix_from": scope.source.contract_hash if scope.source else None,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        if phase == 0:
            sources = {**scope.source_rows(), **rows}
            return [
                prefix_unit(
                    UnitKey.prefix(self.name, item.id),
                    item,
                    PREFIX_DTYPE,
                    _source_for(item, PREFIX_DTYPE, sources),
                )
                for item in selection.items
            ]
        units = []
        for dtype in scope.dtypes:
            for item in selection.items:
                prefix = rows[str(UnitKey.prefix(self.name, item.id))]
                if prefix.data["status"] != "ok":
                    continue
                inputs = prefix_inputs(prefix)
                inputs["source"] = prefix.data["source"]
                matched = rows.get(str(UnitKey(MATCHED, item.id, dtype)))
                if matched is not None and matched.data.get("status") == "ok":
                    inputs["reuse"] = {
                        "prefill": {"key": matched.key, "arm": matched.data["arms"]["prefill"]}
                    }
                units.append(Unit(UnitKey(self.name, item.id, dtype), item, dtype, inputs))
        return units

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows, prefixed=True)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        if unit.key.is_prefix:
            return prefix_row(worker, unit, clock)
        base = {"item_id": unit.item.id, "precision": unit.precision}
        return {**base, "kind": "matrix", **run_matrix(worker, unit, clock, left="replay")}

    def csv_rows(self, rows: list[Record]) -> list[dict[str, Any]]:
        by_key = {r.key: r for r in rows}
        out = []
        for record in rows:
            if record.data.get("kind") != "matrix" or record.data["status"] != "ok":
                continue
            prefix_row = by_key[str(UnitKey.prefix(self.name, record.data["item_id"]))]
            source = record.data["source"].get("row_sha256") or prefix_row.row_sha256
            out.append(matrix_csv_row(record, "incremental", source))
        return out
