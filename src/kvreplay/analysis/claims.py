"""Turn a folder of validated ledgers into a claims JSON in the paper's schema.

Each section carries exactly the keys of the paper's claims skeleton, computed as the
paper's published method specifies (each experiment's section in its own module under
``analysis/sections``), so a user's run and the paper's published ledgers can be compared
number for number. Anything beyond the paper lives under `extra`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kvreplay.analysis.ledgers import load_ledger_dir
from kvreplay.analysis.rates import Json
from kvreplay.analysis.sections.registry import SECTIONS
from kvreplay.analysis.sections.section import Reading
from kvreplay.experiments.table import Ledger

SCHEMA = "stage-replay-paper-claims-v1"


def build_claims(folder: Path, ledgers: Mapping[str, Ledger]) -> Json:
    """Claims for every ledger given (keyed by file name), each section from the ledgers
    it reads; a section without its ledgers adds nothing. ``folder`` is where they were
    read, for a run's rows.jsonl (the flip predictor's margins)."""
    claims: Json = {"schema": SCHEMA}
    for section in SECTIONS:
        if own := section.ledgers(ledgers):
            part = section.claims(Reading(folder, own))
            if "extra" in part:
                claims.setdefault("extra", {}).update(part.pop("extra"))
            claims.update(part)
    return claims


def analyze_dir(folder: Path) -> Json:
    """Validate every known ledger in a folder and compute its claims."""
    return build_claims(folder, load_ledger_dir(folder))


def write_claims(claims: Json, path: Path) -> None:
    """Sorted keys and a trailing newline, so reruns diff cleanly."""
    path.write_text(json.dumps(claims, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def summary_lines(claims: Json) -> list[str]:
    """One plain line per section with its headline numbers."""
    return [line for section in SECTIONS for line in section.summary(claims)]
