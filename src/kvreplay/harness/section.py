"""The shape of a section (design: experiments): the tables an experiment's section
reads, and what their ledgers add to claims.json, the ``analyze`` summary, the report's
headline beside the paper and the report's body. A section's claims are a dataclass
(its ``claims_type``, design: typed claims): claims.json is their encoding
(:func:`kvreplay.core.claims.encode`) and the summary, headline and report read their
fields. ``build_claims`` and the report iterate the registry of sections; a section
whose tables the folder lacks adds nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvreplay.core.claims import Json, decode, encode
from kvreplay.harness.table import Ledger, Table
from kvreplay.ledger import Record
from kvreplay.render.document import Block

if TYPE_CHECKING:  # the report hands a section its Figures; analysis loads no matplotlib
    from kvreplay.render.figures import Figures

Row = tuple[str, ...]
C = TypeVar("C")


@dataclass(frozen=True)
class Reading:
    """What a section's claims come from: its ledgers, by file name, and a run's rows
    (None: a folder of CSVs alone), which a reader may iterate more than once and must
    not keep whole."""

    ledgers: Mapping[str, Ledger]
    records: Iterable[Record] | None


@dataclass(frozen=True)
class Page(Generic[C]):
    """What a section's report blocks come from: its claims, the section's ledgers and
    the run's rows, and the report's figures."""

    claims: C
    ledgers: Mapping[str, Ledger]
    records: Iterable[Record] | None
    figures: Figures


def _none(_: Any) -> list[Any]:
    return []


@dataclass(frozen=True)
class Section(Generic[C]):
    """A section, by name: the tables it reads and what it makes of them. Its claims are
    one ``claims_type`` (a dataclass whose fields carry :func:`kvreplay.core.claims.key`
    metadata where claims.json names them otherwise); the summary, headline and report
    take them as that type. The paper's sections come first, in the paper's reading
    order (``paper_order``); the rest follow in the order they are declared."""

    name: str
    tables: tuple[Table, ...]
    claims_type: type[C]
    claims: Callable[[Reading], C]
    summary: Callable[[C], list[str]] = _none
    headline: Callable[[C], list[Row]] = _none
    report: Callable[[Page[C]], list[Block]] = _none
    paper_order: int | None = None

    def ledgers(self, ledgers: Mapping[str, Ledger]) -> dict[str, Ledger]:
        """The ledgers this section reads, by file name."""
        return {name: ledger for name, ledger in ledgers.items() if ledger.table in self.tables}

    def write(self, claims: C) -> Json:
        """Its part of claims.json."""
        return encode(claims)

    def read(self, data: Json) -> C | None:
        """Its claims from claims.json, or None where claims.json holds none."""
        return decode(self.claims_type, data)
