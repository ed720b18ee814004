"""Recorded prefixes: how a prefix is stored in a row, and how a later unit takes it up
again (a two-phase experiment's prefix row copies one from a source run, takes a
trajectory item's own, or generates one live)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item, encode_prompt
from kvreplay.core.trajectory import Prefix, Trajectory
from kvreplay.harness.blocks import live_state
from kvreplay.harness.rows import PREFIX_FIELDS
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.backends.hf.loading import LoadedModel


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
        _, prefix = live_state(
            lm, prompt_ids(worker, lm, unit.item), worker.config.plan, worker.config.sampler
        )
    return {
        **base,
        "status": "ok" if prefix.reached else "unreached",
        "source": {"key": str(unit.key), "generated": True},
        **prefix_record(prefix),
    }


def prompt_ids(worker: Workbench, lm: LoadedModel, item: Item) -> list[int]:
    if item.prompt is None:
        raise KvreplayError(f"Item {item.id} has no prompt, so it cannot be generated live.")
    return encode_prompt(lm.tokenizer, item.prompt, worker.config.chat)


def prefix_record(prefix: Prefix) -> dict[str, Any]:
    """How a prefix is stored in a row: ids, where the prompt ends, its stages."""
    return {
        "prefix_token_ids": prefix.token_ids,
        "prompt_token_count": prefix.prompt_len,
        "prefix_token_count": len(prefix.token_ids),
        "prefix_sha256": prefix.sha256,
        "prefix_reached": prefix.reached,
        "prefix_reason": prefix.reason,
        "prefix_stages": Trajectory(prefix.segments).to_dict(digests=False)["segments"],
    }


def prefix_from_inputs(inputs: dict[str, Any]) -> Prefix:
    ids = [int(t) for t in inputs["prefix_token_ids"]]
    if sha256_tokens(ids) != inputs["prefix_sha256"]:
        raise KvreplayError("A recorded prefix does not match its own hash.")
    return Prefix(token_ids=ids, prompt_len=int(inputs["prompt_token_count"]))
