"""The run folder's files beside the ledger: nothing unexpected in it, a torn last line
named, and every derived file (CSVs, claims, report, figures) re-derived from the rows
and compared byte for byte."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import open_regular
from kvreplay.experiments import recorded_experiment
from kvreplay.experiments.registry import recorded_table
from kvreplay.ledger import (
    ENGINE_LOG,
    ITEMS,
    MANIFEST,
    ROWS,
    RunLedger,
    RunRows,
)

# What a run folder holds besides its experiments' CSVs and what the audit re-derives.
RUN_FILES = (
    MANIFEST, ITEMS, ROWS, ".kvreplay.lock", "claims.json", "report.md", "report.html", ENGINE_LOG,
)  # fmt: skip


TORN = re.compile(r"rows\.torn-[0-9]+\.jsonl")  # a torn last line a resume set aside


def check_files(ledger: RunLedger, rows: RunRows, snapshots: set[str]) -> list[str]:
    """Every file in the run folder is one a run writes (``snapshots``: the files its
    rows name), and each derived file (claims, report, figures) is byte-identical to its
    re-derivation from the checked ledgers."""
    run_dir, experiments = ledger.run_dir, ledger.manifest["experiments"]
    expected = set(RUN_FILES) | {"figures", "snapshots"}
    for name, entry in experiments.items():
        table = recorded_table(name, ledger.manifest)
        if table is not None:
            expected.add(table.csv_name(entry["config"]))
    problems = [
        f"{path.name}: not a file this run wrote"
        for path in sorted(run_dir.iterdir())
        if path.name not in expected and not TORN.fullmatch(path.name)
    ]
    if (run_dir / "snapshots").is_dir():
        problems += [
            f"snapshots/{path.name}: not a snapshot any row names"
            for path in sorted((run_dir / "snapshots").iterdir())
            if f"snapshots/{path.name}" not in snapshots
        ]
    with tempfile.TemporaryDirectory(prefix="kvreplay-audit-") as scratch:
        problems += _check_derived(ledger, rows, Path(scratch))
    return problems


def _check_derived(ledger: RunLedger, rows: RunRows, scratch: Path) -> list[str]:
    """Re-derive claims.json, the report and figures/ into ``scratch`` and compare bytes."""
    from kvreplay.analysis.claims import analyze_dir, write_claims

    run_dir, problems = ledger.run_dir, []
    for name in ledger.manifest["experiments"]:
        experiment = recorded_experiment(name, ledger.manifest)
        if experiment is not None:
            experiment.figures(scratch, rows.of(name))
    report = (run_dir / "report.md").exists() or (run_dir / "report.html").exists()
    try:
        claims = analyze_dir(run_dir) if report or (run_dir / "claims.json").exists() else None
        if claims is not None and (run_dir / "claims.json").exists():
            write_claims(claims, scratch / "claims.json")
        if report:
            from kvreplay.report.build import build_report

            build_report(run_dir, scratch, claims)  # from the claims the rows derive
    except (KvreplayError, ValueError, KeyError, TypeError) as exc:
        return [f"claims.json or the report cannot be re-derived from the ledgers ({exc})"]
    derived = [p for p in ("claims.json", "report.md", "report.html") if (run_dir / p).exists()]
    if (run_dir / "figures").is_dir():
        derived += [f"figures/{p.name}" for p in sorted((run_dir / "figures").iterdir())]
    for name in derived:
        mine, theirs = scratch / name, run_dir / name
        if not mine.is_file():
            problems.append(f"{name}: not a file this run's ledgers derive")
        elif not theirs.is_file() or mine.read_bytes() != theirs.read_bytes():
            problems.append(f"{name}: differs from its re-derivation from the ledgers")
    return problems


def torn(path: Path) -> bool:
    """Whether rows.jsonl ends inside a line (an interrupted append), read from its end."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open_regular(path) as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"
