"""The ``localize`` CSV (``localize.csv``): one line per probe of a divergent row, each a
set of the donor's K/V layers (keys, values or both) transplanted into the recipient and
decoded against the donor's suffix. A probe that recovers the donor has no divergence
index and carries the donor's suffix hash; one that leaves it has the index, no hash."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvreplay.harness.columns import Column, Kind
from kvreplay.harness.rows import ArmResult, PanelRow
from kvreplay.harness.table import Ledger, Table, check_same
from kvreplay.ledger import Record

LOCALIZE = "localize"
COMPARED = ("left", "prefill")
DIRECTIONS = (
    ("incremental_cache_into_prefill", "left", "prefill"),
    ("prefill_cache_into_incremental", "prefill", "left"),
)
"""Directions: (name, donor arm, recipient arm); the first is always probed."""
SWEEPS = ("single", "prefix", "suffix", "component", "bisect", "minimal")


@dataclass(frozen=True)
class Probe:
    """One transplanted layer set and what its continuation did against the donor."""

    direction: str
    sweep: str
    layers: list[int]
    component: str
    recovers_donor: bool
    first_divergence_index: int | None


def layer_label(layers: Sequence[int]) -> str:
    """``0-3``, ``5`` or ``0-2,7``: contiguous runs joined by commas."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


@dataclass(frozen=True)
class ProbeLine:
    """A CSV line: one probe of a row."""

    row: PanelRow
    probe: Probe

    @property
    def donor(self) -> ArmResult:
        donor = next(donor for name, donor, _ in DIRECTIONS if name == self.probe.direction)
        return self.row.arms[donor]


def _probe(name: str, kind: Kind) -> Column[ProbeLine]:
    return Column(name, kind, get=lambda x: getattr(x.probe, name))


COLUMNS: tuple[Column[ProbeLine], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("precision", "text", get=lambda x: x.row.precision),
    _probe("direction", "text"),
    _probe("sweep", "text"),
    Column("layers", "text", get=lambda x: layer_label(x.probe.layers)),
    Column("layer_count", "int", get=lambda x: len(x.probe.layers)),
    _probe("component", "text"),
    _probe("recovers_donor", "bool"),
    _probe("first_divergence_index", "optional_int"),
    Column(
        "suffix_sha256",
        "optional_sha256",
        get=lambda x: x.donor.suffix_sha256 if x.probe.recovers_donor else None,
    ),
    Column("num_layers", "int", get=lambda x: x.row.fields["num_layers"]),
    Column("source_row_sha256", "sha256", get=lambda x: x.row.fields["source"]["row_sha256"]),
    Column("boundary_argmax_equal", "bool", get=lambda x: x.row.fields["boundary_argmax_equal"]),
)


def probe_lines(rows: Iterable[Record]) -> Iterator[ProbeLine]:
    for record in rows:
        row = PanelRow.from_dict(record.data, COMPARED)
        yield from (ProbeLine(row, Probe(**probe)) for probe in row.fields["probes"])


def _check_recovery(ledger: Ledger) -> None:
    """Gate: a probe has a divergence index and no suffix hash exactly when it leaves
    the donor."""
    recovered = ledger["recovers_donor"]
    ledger.require(
        np.isnan(ledger["first_divergence_index"]) == recovered,
        "first_divergence_index",
        "it must be empty exactly when recovers_donor is true",
    )
    hashed = np.array([value is not None for value in ledger["suffix_sha256"]])
    ledger.require(
        hashed == recovered, "suffix_sha256", "it must be given exactly when recovers_donor is true"
    )


LOCALIZE_TABLE = Table(
    "localize.csv",
    COLUMNS,
    LOCALIZE,
    probe_lines,
    ("precision", "row_id", "direction", "sweep", "layers", "component"),
    # a run probes at one precision, on one model
    (check_same("precision"), check_same("num_layers"), _check_recovery),
)
