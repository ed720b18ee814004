"""What each row says of itself, checked as the chain check reads it (:class:`RowChecks`):
the row read as its experiment's row, its labels and scores against the tokenizer and
extractor, its inputs against the config, and its snapshots."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from kvreplay.audit.consistency import Scorer, row_problems
from kvreplay.audit.plan import LINKS, Copies, small_target
from kvreplay.audit.snapshots import SnapshotCheck, row_snapshots
from kvreplay.backends import precisions
from kvreplay.contract.config import RunConfig
from kvreplay.core.canonical import canonical, sha256_json
from kvreplay.core.items import Item
from kvreplay.experiments import recorded_experiment
from kvreplay.harness.rows import PREFIX_FIELDS, PanelRow, row_as_written
from kvreplay.harness.units import UnitKey
from kvreplay.ledger import Record, RunLedger, diff_fields
from kvreplay.model.reading import load_tokenizer

if TYPE_CHECKING:
    from kvreplay.harness.experiment import Experiment


def read_record(
    record: Record, experiment: Experiment | None
) -> tuple[PanelRow | None, str | None]:
    """A row typed (None where there is nothing to type: a prefix row, an unreached one,
    an experiment this kvreplay does not know), or what is wrong with a row every check
    relies on: a field missing or of the wrong kind, or a completed row that does not
    read as its experiment's typed row."""
    data = record.data
    checks = {
        "item_id": isinstance(data.get("item_id"), str),
        "precision": data.get("precision") in precisions(),
        "status": isinstance(data.get("status"), str),
        "inputs": isinstance(data.get("inputs", {}), dict),
    }
    wrong = next((name for name, ok in checks.items() if not ok), None)
    if wrong is not None:
        return None, f"field {wrong} is missing or malformed"
    if experiment is None or data.get("kind") == "prefix" or data["status"] != "ok":
        return None, None
    try:
        return experiment.read_row(data), None
    except Exception as exc:  # noqa: BLE001 - hand-edited data can fail in any way
        return None, f"does not read as a {record.experiment} row ({type(exc).__name__}: {exc})"


APART = ("inputs", "kind")  # checked apart: against the config, and the row's key


def round_trip_problems(data: dict[str, Any], row: PanelRow) -> list[str]:
    """A completed panel row against the typed row it reads as, written back: a field
    the typed row does not write (one added inside an arm, a comparison or a gate) is
    named by its path."""
    recorded, written = (
        json.loads(canonical({k: v for k, v in d.items() if k not in APART}))
        for d in (row_as_written(data), row.to_dict())
    )
    return [
        f"field {path} is not one its typed row writes" for path in diff_fields(recorded, written)
    ]


def consistency_problems(record: Record, row: PanelRow | None, scorer: Scorer | None) -> list[str]:
    """What a row says of itself (:mod:`kvreplay.audit.consistency`), checked on every row:
    the sample only limits which rows are re-executed. A row whose re-derivation fails
    (a hand-edited field of the wrong kind) is named, not raised."""
    try:
        found = row_problems(record.data, row, scorer)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        found = [f"cannot be re-derived from its own fields ({type(exc).__name__})"]
    return [f"row {record.key}: {p}" for p in found]


class RowChecks:
    """What an audit checks of each row from the folder alone, as the chain check reads
    it (:meth:`visit`): that it reads as its experiment's row, what it says of itself,
    its inputs against what the run's config derives, and its snapshots. Of each row it
    keeps only what a later check needs (the snapshots it names, the rows its inputs
    copy from), so an audit of any size holds one row at a time. Without ``config`` (a
    forged contract or items) nothing is checked against the model."""

    def __init__(
        self,
        ledger: RunLedger,
        derived: dict[str, dict[str, Any]],
        config: RunConfig | None,
        item_list: list[Item] | None,
    ):
        self.manifest, self.derived = ledger.manifest, derived
        self.problems: list[str] = []
        self.unread: set[str] = set()  # rows that do not read as their experiment's
        self.snapshots: set[str] = set()  # the snapshot files the rows name
        self.holding: str | None = None  # the first row that holds a snapshot
        self.copies: list[Copies] = []
        self.experiments: dict[str, Experiment | None] = {}
        self.tokenizer: Any = None
        self.scorer: Scorer | None = None
        self.backend = config.backend if config is not None else None
        self.snapshot_check: SnapshotCheck | None = None
        if config is not None:
            layout = functools.cache(
                lambda tokens: config.backend.state_layout(config.model, tokens)
            )
            layers = ledger.manifest["contract"].get("model_info", {}).get("num_layers")
            self.snapshot_check = SnapshotCheck(ledger.run_dir, layout, layers)
            self.tokenizer = load_tokenizer(config.model, config.backend.trusts_remote_code)
            answers = {i.id: i.answer for i in item_list} if item_list is not None else None
            self.scorer = Scorer(self.tokenizer, config.extractor, answers)

    def visit(self, record: Record) -> None:
        snapshots = row_snapshots(record.data)
        if snapshots and self.holding is None:
            self.holding = record.key
        if record.experiment not in self.experiments:
            self.experiments[record.experiment] = recorded_experiment(
                record.experiment, self.manifest
            )
        row, why = read_record(record, self.experiments[record.experiment])
        if why is not None:
            self.problems.append(f"row {record.key}: {why}")
            self.unread.add(record.key)
            return
        self.snapshots.update(str(entry.get("file")) for _, _, entry in snapshots)
        self.problems += self.schema_problems(record, row)
        self.problems += self.input_problems(record)
        if self.snapshot_check is not None:
            self.problems += self.snapshot_check(record)
            self.problems += consistency_problems(record, row, self.scorer)

    def schema_problems(self, record: Record, row: PanelRow | None) -> list[str]:
        """The row against its experiment's declared schema (:mod:`kvreplay.harness.schema`):
        its fields, their types and values, its key, its relations to the config, and a
        panel row's nested records as its typed row writes them back."""
        experiment = self.experiments[record.experiment]
        if experiment is None:
            return []  # an experiment this kvreplay does not know: named elsewhere
        schema = experiment.declaration.schema
        assert schema is not None  # a declaration without one is refused
        entry = self.manifest["experiments"].get(record.experiment)
        config = entry.get("config") if isinstance(entry, dict) else None
        found = schema.row_problems(record.data, config, self.backend)
        if str(UnitKey.of(record)) != record.key:
            found.append("field item_id, precision or kind is not its key's")
        if schema.round_trip and row is not None and not found:
            found += round_trip_problems(record.data, row)
        return [f"row {record.key}: {p}" for p in found]

    def input_problems(self, record: Record) -> list[str]:
        """What a row's recorded inputs may hold, checked before they are re-executed.

        Re-execution takes no result from the row it re-executes: a ``reuse`` entry (a
        recorded suffix standing in for a computed one) is never recorded by a run, so
        it is named. Inputs an experiment derives from its config and items must be what
        it derives. What they copy from elsewhere is kept to check once every row is
        read (:func:`check_copies`)."""
        inputs = record.data.get("inputs", {})
        where = f"row {record.key}: field inputs"
        problems = []
        if "reuse" in inputs:
            problems.append(f"{where}.reuse stands in for a computed result; no run records it")
        for field_name, value in self.derived.get(record.key, {}).items():
            if canonical(inputs.get(field_name)) != canonical(value):
                problems.append(f"{where}.{field_name} is not what the run's config derives")
        links = tuple(
            (link, small_target(target))
            for link in LINKS
            if isinstance(target := inputs.get(link), dict) and isinstance(target.get("key"), str)
        )
        if links or "prefix_sha256" in inputs:
            prefix_row = str(UnitKey.prefix(record.experiment, record.data["item_id"]))
            copies_prefix = prefix_row != record.key and "prefix_sha256" in inputs
            self.copies.append(
                Copies(
                    record.key,
                    prefix_row if copies_prefix else None,
                    links,
                    {name: sha256_json(inputs[name]) for name in PREFIX_FIELDS if name in inputs},
                )
            )
        return problems
