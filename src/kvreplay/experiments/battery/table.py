"""The ``battery`` CSV (``battery_shapes.csv``): one line per item, precision and request
shape, each the shape's hit against its reference miss: their continuations' hashes,
whether they agree at the token level and bit for bit, the cached tokens each read and
the ones the history wrote, the level the shape is compared at, and whether it parts
there (a detection)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvreplay.experiments.battery.outcome import ShapeOutcome, shape_outcomes
from kvreplay.harness.columns import Column, written
from kvreplay.harness.rows import ArmResult, PanelRow
from kvreplay.harness.table import Table
from kvreplay.ledger import Record

BATTERY = "battery"


@dataclass(frozen=True)
class ShapeLine:
    """A CSV line: one shape of one row, and the ledger row it is sourced from."""

    row: PanelRow
    shape: ShapeOutcome
    source_row_sha256: str


def shape_lines(rows: Iterable[Record]) -> Iterator[ShapeLine]:
    """Every shape a completed row ran, in the order it ran them."""
    from kvreplay.experiments.battery.experiment import typed_row

    for record in rows:
        if record.data.get("status") == "ok":
            row = typed_row(record.data)
            for shape in shape_outcomes(row):
                yield ShapeLine(row, shape, record.row_sha256)


def _sha(arm: ArmResult | None) -> str | None:
    return None if arm is None else arm.suffix_sha256


COLUMNS: tuple[Column[ShapeLine], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("source_row_sha256", "sha256", get=lambda x: x.source_row_sha256),
    Column("precision", "text", get=lambda x: x.row.precision),
    Column("backend", "text", get=lambda x: x.row.fields["backend"]),
    Column("shape", "text", get=lambda x: x.shape.shape),
    Column("level", "text", get=lambda x: x.shape.level),
    Column("exercised", "optional_bool", get=lambda x: x.shape.exercised),
    Column("miss_suffix_sha256", "optional_sha256", get=lambda x: _sha(x.shape.miss)),
    Column("hit_suffix_sha256", "optional_sha256", get=lambda x: _sha(x.shape.hit)),
    Column("miss_cached_tokens", "optional_int", get=lambda x: x.shape.miss_cached),
    Column("hit_cached_tokens", "optional_int", get=lambda x: x.shape.hit_cached),
    Column("expected_cached_tokens", "optional_int", get=lambda x: x.shape.expected_cached),
    Column("tokens_equal", "bool", get=lambda x: x.shape.tokens_equal),
    Column("bits_equal", "bool", get=lambda x: x.shape.bits_equal),
    Column("detected", "bool", get=lambda x: x.shape.detected),
    Column("first_divergent_step", "optional_int", get=lambda x: x.shape.first_step),
    Column("live_equal", "optional_bool", use="optional", get=lambda x: x.shape.live_equal),
    *written(Column("note", "optional_text", get=lambda x: x.shape.note)),
)

BATTERY_TABLE = Table(
    "battery_shapes.csv",
    COLUMNS,
    BATTERY,
    shape_lines,
    ("precision", "row_id", "shape"),
)
