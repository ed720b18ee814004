"""What ``kvreplay audit`` is asked: how many rows to re-execute and which, where they run
(the same :class:`~kvreplay.engines.placement.Placement` as a run's), and whether a model
that ships its own code may run. Each option is declared once, on its field."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.core.options import COUNTS, SEEDS, bounds, option
from kvreplay.engines.placement import Placement


@dataclass(frozen=True)
class AuditRequest:
    """An audit's choices (the run folder and a server's address are given beside it)."""

    sample: int | None = field(
        default=None,
        metadata=option(
            "--sample",
            "Re-execute a seeded sample of K rows (default: every row). The checks that need "
            "no re-execution (hashes, CSVs, labels and scores re-derived from each row's "
            "tokens, snapshots) run on every row whatever K is; --sample 0 is those checks "
            "alone: structure only, no row re-executed (see docs/audit.md).",
            minimum=0,
            maximum=COUNTS[1],
        ),
    )
    seed: int = field(
        default=0, metadata=option("--seed", "Seed of the --sample draw.", **bounds(SEEDS))
    )
    placement: Placement = field(default_factory=Placement)
    trust_remote_code: bool = field(
        default=False,
        metadata=option(
            "--trust-remote-code",
            "Allow re-executing a run whose model ships its own Python code.",
        ),
    )
