"""A CSV's columns, each declared once: its name, its kind (how a cell is written and
read back), what analysis makes of it, the schema version that added it, and, where
kvreplay writes the CSV, the getter that reads its value from a typed line. The CSV's
header, its lines, the audit's comparison and the analysis reader all follow the one
declaration, so they cannot drift apart. Plain data, no torch."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar, cast

from kvreplay.core.comparison import Comparison
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.harness.rows import PanelRow
from kvreplay.ledger import Record, heads

T = TypeVar("T")

Kind = Literal[
    "text",
    "optional_text",
    "bool",
    "optional_bool",
    "sha256",
    "optional_sha256",
    "int",
    "optional_int",
    "float",
    "optional_float",
    "float_list",
    "optional_float_list",
    "json",
    "optional_json",
]
"""A cell's kind; an ``optional_`` kind also takes an empty cell (a value that does not
apply to the row, or a column a served backend cannot fill)."""

Use = Literal["required", "optional", "written"]
"""What analysis makes of a column: it refuses a CSV without a ``required`` one (the
paper's columns, and what claims and gates read), reads an ``optional`` one where the
CSV has it, and leaves a ``written`` one (kept for people and for the audit) unread."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


def optional(kind: Kind) -> Kind:
    """The kind that also takes an empty cell."""
    return cast(Kind, "optional_" + kind.removeprefix("optional_"))


@dataclass(frozen=True)
class Field:
    """A column as analysis reads it. ``since`` is the CSV schema version that added it:
    a run renders the columns of the version its config records (design: schema version).
    A column that is not ``held`` is read and checked on every line (its kind, the
    table's line checks) but not kept once its line is checked: what no claim reads
    (a digest whose agreement a flag states, a per-layer list only the report draws)
    does not grow analysis with the rows (read it again with :meth:`Ledger.lines`)."""

    name: str
    kind: Kind
    use: Use = "required"
    since: int = 1
    held: bool = True

    def __post_init__(self) -> None:
        # a CSV of an earlier version lacks the column, so analysis cannot require it
        assert self.since == 1 or self.use != "required", f"{self.name} was added later"


@dataclass(frozen=True, kw_only=True)
class Column(Field, Generic[T]):
    """A column kvreplay writes: how a line's value is read."""

    get: Callable[[T], Any]


def written(*columns: Column[T]) -> list[Column[T]]:
    """Columns kvreplay writes beside the paper's; analysis leaves them unread."""
    return [replace(column, use="written") for column in columns]


@dataclass(frozen=True)
class Line:
    """A CSV line of a panel row: the typed row and the ledger row it is sourced from."""

    row: PanelRow
    source_row_sha256: str


def prefix_row_hashes(rows: Iterable[Record]) -> dict[str, str]:
    """Each prefix row's row_sha256 by key: what a row sourced from its prefix names."""
    return {r.key: r.row_sha256 for r in heads(rows) if r.data.get("kind") == "prefix"}


def reached_lines(compared: tuple[str, str]) -> Callable[[Iterable[Record]], Iterator[Line]]:
    """A table's lines: every row that reached the boundary, sourced from itself."""
    return lambda rows: (
        Line(PanelRow.from_dict(r.data, compared), r.row_sha256)
        for r in rows
        if r.data["status"] == "ok"
    )


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


def parse_cell(kind: Kind, text: str) -> object:
    """One cell to its typed value (an empty optional cell: NaN for a number, else None);
    raises ValueError with the reason."""
    base = kind.removeprefix("optional_")
    if text == "" and base != kind:
        return math.nan if base in ("int", "float") else None
    return _PARSERS[base](text)


def _text(text: str) -> str:
    if not text:
        raise ValueError("is empty")
    return text


def _bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"is {text!r}, not true or false")
    return text == "true"


def _sha256(text: str) -> str:
    if not _SHA256.fullmatch(text):
        raise ValueError(f"is {text!r}, not 64 lowercase hex characters")
    return text


def _int(text: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"is {text!r}, not an integer")
    return int(text)


def _json(text: str) -> Any:
    try:
        return parse_json(text)
    except JsonError:
        raise ValueError(f"is {text[:40]!r}, not JSON") from None


def _float_list(text: str) -> list[float]:
    try:
        values = parse_json(text)
    except JsonError:
        values = None
    if not isinstance(values, list) or not values:
        raise ValueError(f"is {text[:40]!r}, not a JSON array of numbers")
    return [_finite(v) for v in values]


def _finite(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"is {value!r}, not a number") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"is {value!r}, not a finite number")
    return number


_PARSERS: dict[str, Callable[[str], Any]] = {
    "text": _text,
    "bool": _bool,
    "sha256": _sha256,
    "int": _int,
    "float": _finite,
    "json": _json,
    "float_list": _float_list,
}
