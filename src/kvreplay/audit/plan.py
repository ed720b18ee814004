"""What the rows must be, from the recorded config and items alone: the planned keys and
an early stop, each row's derived inputs, and the inputs rows copy from other rows (in
this run or the run it read ``--from``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvreplay.contract.config import RunConfig
from kvreplay.core.canonical import sha256_json
from kvreplay.core.items import Item
from kvreplay.experiments import recorded_experiment
from kvreplay.harness.prefixes import trajectory_inputs
from kvreplay.harness.rows import PREFIX_FIELDS
from kvreplay.ledger import (
    STOPPED,
    Record,
    RunLedger,
    RunRows,
)


def check_plan(ledger: RunLedger, rows: RunRows, item_order: list[str]) -> list[str]:
    """Every experiment's config against its hash and items.jsonl, and its rows against
    the rows that config plans: a missing row is named, so is one nobody planned. The
    plan reads the few rows it depends on (prefix rows, screens) when it asks for them."""
    problems = []
    by_key = rows.by_key()
    experiments = ledger.manifest["experiments"]
    for name, entry in experiments.items():
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is None:
            continue  # named by check_csvs
        where = f"manifest.json: field experiments.{name}"
        config = entry["config"]
        if entry.get("config_sha256") != sha256_json(config):
            problems.append(f"{where}.config_sha256 does not match its config")
        ids = config.get("item_ids")
        if "selection" not in config and ids != item_order[: len(ids) if type(ids) is list else 0]:
            problems.append(f"{where}.config.item_ids is not the first items of items.jsonl")
        try:
            planned = experiment.planned(config, by_key)
        except (KeyError, TypeError, AttributeError) as exc:  # a hand-edited config
            problems.append(f"{where}.config is malformed ({type(exc).__name__})")
            continue
        wanted = set(planned)
        stop = entry.get(STOPPED)
        if stop is not None:
            why = stop_problem(experiment, stop, planned, by_key)
            if why:
                problems.append(f"{where}.{STOPPED}: {why}")
            else:
                planned = planned[: planned.index(stop["after"]) + 1]
        problems += [
            f"row {key}: missing from rows.jsonl (planned by experiments.{name}.config)"
            for key in planned
            if key not in by_key
        ]
        problems += [
            f"row {at.key}: not planned by experiments.{name}.config"
            for at in rows.index
            if at.experiment == name and at.key not in wanted
        ]
    problems += [
        f"row {at.key}: field experiment names {at.experiment!r}, which manifest.json does not list"
        for at in rows.index
        if at.experiment not in experiments
    ]
    return problems


def stop_problem(
    experiment: Any, stop: Any, planned: list[str], rows: Mapping[str, Record]
) -> str | None:
    """What is wrong with a recorded early stop, or None: it must name a planned row,
    every row before it must be there and none after it, and its rule must decide at
    that row and not before (so a stop cannot hide rows that would have passed)."""
    from kvreplay.verify.verdict import StopRule

    try:
        rule = StopRule.from_json(experiment, stop["rule"])
        cut = planned.index(stop["after"]) + 1
    except (KeyError, TypeError, ValueError):
        return "is malformed"
    kept = [rows.get(key) for key in planned[:cut]]
    if None in kept or any(key in rows for key in planned[cut:]):
        return "does not match the rows in rows.jsonl"
    ran = [r for r in kept if r is not None]
    if not rule(ran) or rule(ran[:-1]):
        return "its rule does not decide at its last row"
    return None


def derived_inputs(
    ledger: RunLedger, config: RunConfig, items: dict[str, Item]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The inputs each row's unit takes from the recorded configs and items alone, by row
    key (see :meth:`Experiment.derived_inputs`), and each config that derives none."""
    derived: dict[str, dict[str, Any]] = {}
    problems = []
    for name, entry in ledger.manifest["experiments"].items():
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is not None:
            try:
                derived |= experiment.derived_inputs(entry["config"], config, items)
            except (KeyError, TypeError, IndexError):
                problems.append(f"manifest.json: field experiments.{name}.config is malformed")
    return derived, problems


# Inputs that link a row to the row (or trajectory item) its prefix was copied from.
LINKS = ("source", "historical")


NULL = sha256_json(None)  # a prefix field the inputs do not hold


def small_target(target: dict[str, Any]) -> dict[str, Any]:
    """What a link's target names: a row's key and hashes (nothing else is compared)."""
    return {k: target[k] for k in ("key", "row_sha256", "prefix_sha256") if k in target}


@dataclass(frozen=True)
class Copies:
    """What a row's inputs say they copy, kept to check once every row is read: its own
    prefix row (where it copies a prefix and is not that row), the links it records, and
    a digest of each prefix field its inputs hold."""

    row: str
    prefix_row: str | None
    links: tuple[tuple[str, dict[str, Any]], ...]
    fields: dict[str, str]


@dataclass(frozen=True)
class Source:
    """A row that another row's inputs copy from, as far as the copy is compared."""

    row_sha256: str
    prefix_sha256: Any
    fields: dict[str, str]

    @classmethod
    def of(cls, record: Record) -> Source:
        data = record.data
        fields = {name: sha256_json(data.get(name)) for name in PREFIX_FIELDS}
        return cls(record.row_sha256, data.get("prefix_sha256"), fields)


def check_copies(
    copies: list[Copies], rows: RunRows, items: dict[str, Item]
) -> tuple[list[str], dict[str, set[str]], int]:
    """Inputs copied from elsewhere: a prefix copied from another row of this run must
    be that row's (which is then re-executed too), and a later phase's prefix its own
    prefix row's; a trajectory item's must be the item's. Returns the problems, each
    row's in-run dependencies, and how many rows copy from another run (which this
    audit cannot re-execute). The rows copied from are read when a copy names them."""
    problems: list[str] = []
    depends: dict[str, set[str]] = {}
    foreign = 0
    by_key = rows.by_key()
    sources: dict[str, Source] = {}

    def copied(where: str, link: str, target: dict[str, Any], copy: Copies, key: str) -> None:
        if key not in sources:
            sources[key] = Source.of(by_key[key])
        source = sources[key]
        depends.setdefault(copy.row, set()).add(key)
        if "row_sha256" in target and target["row_sha256"] != source.row_sha256:
            problems.append(f"{where}.{link}.row_sha256 is not row {key}'s")
        if "prefix_sha256" in target and target["prefix_sha256"] != source.prefix_sha256:
            problems.append(f"{where}.{link}.prefix_sha256 is not row {key}'s")
        problems.extend(
            f"{where}.{name} is not row {key}'s {name}"
            for name, digest in copy.fields.items()
            if digest != source.fields[name]
        )

    for copy in copies:
        where = f"row {copy.row}: field inputs"
        if copy.prefix_row is not None and copy.prefix_row in by_key:
            copied(where, "prefix", {}, copy, copy.prefix_row)
            continue  # the prefix row carries the link to where the prefix came from
        for link, target in copy.links:
            key = target["key"]
            if key.startswith("items.jsonl:"):
                item = items.get(key.removeprefix("items.jsonl:"))
                expected = trajectory_inputs(item) if item and item.prefix_token_ids else None
                if expected is None or any(
                    copy.fields.get(name, NULL) != sha256_json(expected[name])
                    for name in PREFIX_FIELDS
                ):
                    problems.append(f"{where}.{link} names a trajectory item it does not copy")
            elif key in by_key:
                copied(where, link, target, copy, key)
            else:
                foreign += 1
    return problems, depends, foreign


def with_dependencies(
    chosen: list[str], keys: list[str], depends: dict[str, set[str]]
) -> list[str]:
    """The chosen rows and every row of this run their inputs were copied from, in
    ledger order (``keys``): a copied input is vouched for by re-executing the row it
    came from."""
    wanted = set(chosen)
    stack = list(wanted)
    while stack:
        for key in depends.get(stack.pop(), ()):
            if key not in wanted:
                wanted.add(key)
                stack.append(key)
    return [key for key in keys if key in wanted]
