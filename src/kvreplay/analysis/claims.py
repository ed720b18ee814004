"""Turn a folder of validated ledgers into a claims JSON in the paper's schema.

Each section carries exactly the keys of the paper's claims skeleton, computed as the
paper's published method specifies (each experiment's section in its own module under
``analysis/sections``), so a user's run and the paper's published ledgers can be compared
number for number. Anything beyond the paper lives under `extra`.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvreplay.analysis.ledgers import LedgerDir, load_ledger_dir
from kvreplay.analysis.sections.registry import sections
from kvreplay.core.outputs import write_output
from kvreplay.harness.section import Reading
from kvreplay.measure.rates import Json

SCHEMA = "stage-replay-paper-claims-v1"


def build_claims(folder: LedgerDir) -> Json:
    """Claims for every ledger of a folder, each section from the ledgers it reads (and a
    run's rows); a section without its ledgers adds nothing."""
    claims: Json = {"schema": SCHEMA}
    for section in sections():
        if own := section.ledgers(folder.ledgers):
            part = section.claims(Reading(own, folder.records))
            if "extra" in part:
                claims.setdefault("extra", {}).update(part.pop("extra"))
            claims.update(part)
    return claims


def analyze_dir(folder: Path) -> Json:
    """Validate every known ledger in a folder and compute its claims."""
    return build_claims(load_ledger_dir(folder))


def write_claims(claims: Json, path: Path) -> None:
    """Sorted keys and a trailing newline, so reruns diff cleanly."""
    write_output(path, (json.dumps(claims, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def summary_lines(claims: Json) -> list[str]:
    """One plain line per section with its headline numbers."""
    return [line for section in sections() for line in section.summary(claims)]
