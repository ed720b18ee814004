"""Units of work: one row's key, its plain-data unit (it travels to worker processes and
Ray actors), the clock that splits its time, and what it may use of the worker running it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvreplay.core.items import PREFIX_KEY, Item
from kvreplay.ledger import Record

if TYPE_CHECKING:  # the worker's side; a row's key and unit are plain data, no torch
    from kvreplay.backends.hf.loading import LoadedModel
    from kvreplay.contract.config import RunConfig


@dataclass(frozen=True)
class UnitKey:
    """A row's key in the ledger: ``{experiment}/{item}/{precision}``, or
    ``{experiment}/prefix/{item}`` for the prefix row of a two-phase experiment.

    Unambiguous because item ids hold no ``/`` and none is ``prefix`` (items.py refuses
    them at load)."""

    experiment: str
    item_id: str
    precision: str | None = None  # None: the item's prefix row

    @classmethod
    def prefix(cls, experiment: str, item_id: str) -> UnitKey:
        return cls(experiment, item_id)

    @classmethod
    def of(cls, record: Record) -> UnitKey:
        """The key a recorded row should have, from its experiment, kind, item and precision."""
        data = record.data
        precision = None if data.get("kind") == "prefix" else data["precision"]
        return cls(record.experiment, data["item_id"], precision)

    @property
    def is_prefix(self) -> bool:
        return self.precision is None

    def __str__(self) -> str:
        if self.precision is None:
            return f"{self.experiment}/{PREFIX_KEY}/{self.item_id}"
        return f"{self.experiment}/{self.item_id}/{self.precision}"


@dataclass
class Unit:
    """One row's worth of work: plain data so it can travel to a worker process or actor."""

    key: UnitKey
    item: Item
    precision: str
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def experiment(self) -> str:
        return self.key.experiment


class Clock:
    """Splits a unit's wall time into model time and harness time (everything else)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.model_seconds = 0.0

    @contextmanager
    def model(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.model_seconds += time.perf_counter() - began

    def timing(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        return {"model_s": self.model_seconds, "harness_s": total - self.model_seconds}


class Workbench(Protocol):
    """What a unit's computation uses of the worker that runs it (see
    :class:`kvreplay.engines.worker.Worker`): the run's configuration and each
    precision's model (hf) or engine (vllm), loaded once."""

    config: RunConfig

    def model(self, dtype: str) -> LoadedModel: ...

    def served(self, dtype: str) -> Any: ...
