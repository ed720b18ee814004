"""The shape of a section (design: experiments): the tables an experiment's section
reads, and what their ledgers add to claims.json, the ``analyze`` summary, the report's
headline beside the paper and the report's body. ``build_claims`` and the report iterate
the registry of sections; a section whose tables the folder lacks adds nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvreplay.harness.table import Ledger, Table
from kvreplay.ledger import Record
from kvreplay.measure.rates import Json
from kvreplay.render.document import Block

if TYPE_CHECKING:  # the report hands a section its Figures; analysis loads no matplotlib
    from kvreplay.render.figures import Figures

Row = tuple[str, ...]


@dataclass(frozen=True)
class Reading:
    """What a section's claims come from: its ledgers, by file name, and a run's rows
    (None: a folder of CSVs alone), which a reader may iterate more than once and must
    not keep whole."""

    ledgers: Mapping[str, Ledger]
    records: Iterable[Record] | None


@dataclass(frozen=True)
class Page:
    """What a section's report blocks come from: the claims, the section's ledgers and
    the run's rows, and the report's figures."""

    claims: Json
    ledgers: Mapping[str, Ledger]
    records: Iterable[Record] | None
    figures: Figures


def _none(_: Any) -> list[Any]:
    return []


@dataclass(frozen=True)
class Section:
    """A section, by name: the tables it reads and what it makes of them. Claims are a
    part of claims.json (its keys; ``extra`` merges into the shared extra). The paper's
    sections come first, in the paper's reading order (``paper_order``); the rest follow
    in the order they are declared."""

    name: str
    tables: tuple[Table, ...]
    claims: Callable[[Reading], Json]
    summary: Callable[[Json], list[str]] = _none
    headline: Callable[[Json], list[Row]] = _none
    report: Callable[[Page], list[Block]] = _none
    paper_order: int | None = None

    def ledgers(self, ledgers: Mapping[str, Ledger]) -> dict[str, Ledger]:
        """The ledgers this section reads, by file name."""
        return {name: ledger for name, ledger in ledgers.items() if ledger.table in self.tables}
