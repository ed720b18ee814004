"""Paper CSVs, each declared once as columns of (name, getter): the declaration names the
header, orders it, and renders every line from a typed row, so the CSV, the audit's
comparison and the column list cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvreplay.comparison import Comparison
from kvreplay.experiments.rows import PanelRow

T = TypeVar("T")


@dataclass(frozen=True)
class Column(Generic[T]):
    """One CSV column: its name and how a line's value is read."""

    name: str
    get: Callable[[T], Any]


@dataclass(frozen=True)
class Line:
    """A CSV line of a panel row: the typed row and the ledger row it is sourced from."""

    row: PanelRow
    source_row_sha256: str


def kv(get: Callable[[Comparison], Any]) -> Callable[[Line], Any]:
    """A K/V column's getter: empty on a served row, which has no states to compare."""
    return lambda x: None if x.row.comparison is None else get(x.row.comparison)


def csv_value(value: Any) -> str:
    """CSV convention of the paper's release: booleans as true/false, None as empty."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    return str(value)


def render_lines(columns: list[Column[T]], lines: list[T]) -> list[dict[str, str]]:
    """Each line as the CSV's cells, in the declared order."""
    return [{c.name: csv_value(c.get(line)) for c in columns} for line in lines]
