"""What an experiment is asked to run on, and which items it chose."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.core.options import check_bounds
from kvreplay.ledger import Record


@dataclass(frozen=True)
class SourceRun:
    """Another run named by ``--from``: its rows, read without touching it."""

    path: Path
    rows: dict[str, Record]
    contract_hash: str


@dataclass(frozen=True)
class Scope:
    """What an experiment is asked to run on: the run's configuration, items and
    precisions, the ``--n`` asked for, the ``--from`` run, and its own options."""

    config: RunConfig
    items: list[Item]
    dtypes: tuple[str, ...]
    n: int | None = None
    source: SourceRun | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def source_rows(self) -> dict[str, Record]:
        return self.source.rows if self.source else {}


T = TypeVar("T")


def own_options(kind: type[T], scope: Scope, owner: str) -> T:
    """An experiment's own options as the dataclass ``kind``; an unknown one is refused."""
    unknown = sorted(set(scope.options) - {f.name for f in fields(kind)})
    if unknown:
        raise KvreplayError(f"Option {unknown[0]!r} is not one of {owner}.")
    return check_bounds(kind(**scope.options))


@dataclass(frozen=True)
class Selection:
    """The items an experiment runs, in order, and how they were chosen."""

    items: list[Item]
    rule: dict[str, Any]
