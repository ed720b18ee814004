"""Turn a folder of validated ledgers into a claims JSON in the paper's schema.

Each section carries exactly the keys of the paper's claims skeleton, computed as the
paper's published method specifies (each experiment's section beside its experiment),
so a user's run and the paper's published ledgers can be compared number for number.
Anything beyond the paper lives under `extra`. A section's claims are its dataclass
(design: typed claims); claims.json is their one encoding, and reading it back gives
the dataclasses again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvreplay.analysis.ledgers import LedgerDir, load_ledger_dir
from kvreplay.analysis.sections.registry import sections
from kvreplay.core.claims import ROOT_EXTRA, ClaimsError, Json
from kvreplay.core.outputs import write_output
from kvreplay.harness.section import Reading, Section

SCHEMA = "stage-replay-paper-claims-v1"
C = TypeVar("C")


@dataclass(frozen=True)
class Claims:
    """Every section's claims, by section name (a section without its ledgers has none)."""

    parts: dict[str, Any]

    def of(self, section: Section[C]) -> C | None:
        return self.parts.get(section.name)

    def to_json(self) -> Json:
        """claims.json: the schema, then each section's part (its extra under ``extra``)."""
        out: Json = {"schema": SCHEMA}
        for section in sections():
            if (part := self.of(section)) is None:
                continue
            written = section.write(part)
            extra = written.pop(ROOT_EXTRA, {})
            assert not written.keys() & out.keys(), f"{section.name} writes a key twice"
            out.update(written)
            if extra:
                held = out.setdefault(ROOT_EXTRA, {})
                assert not extra.keys() & held.keys(), f"{section.name} writes extra twice"
                held.update(extra)
        return out

    @classmethod
    def from_json(cls, data: Json) -> Claims:
        """The claims a claims.json holds, each section's as its dataclass."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ClaimsError(f"claims.json: its schema is not {SCHEMA}.")
        return cls({s.name: part for s in sections() if (part := s.read(data)) is not None})


def build_claims(folder: LedgerDir) -> Claims:
    """Claims for every ledger of a folder, each section from the ledgers it reads (and a
    run's rows); a section without its ledgers adds nothing."""
    parts = {}
    for section in sections():
        if own := section.ledgers(folder.ledgers):
            parts[section.name] = section.claims(Reading(own, folder.records))
    return Claims(parts)


def analyze_dir(folder: Path) -> Claims:
    """Validate every known ledger in a folder and compute its claims."""
    return build_claims(load_ledger_dir(folder))


def write_claims(claims: Claims, path: Path) -> None:
    """Sorted keys and a trailing newline, so reruns diff cleanly."""
    text = json.dumps(claims.to_json(), indent=2, sort_keys=True) + "\n"
    write_output(path, text.encode("utf-8"))


def summary_lines(claims: Claims) -> list[str]:
    """One plain line per section with its headline numbers."""
    return [
        line
        for section in sections()
        if (part := claims.of(section)) is not None
        for line in section.summary(part)
    ]
