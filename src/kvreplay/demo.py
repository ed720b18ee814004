"""``make demo`` / ``kvreplay demo``: the three paper experiments on the embedded default
model at a size that finishes in minutes on a laptop CPU, then claims and a report."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from kvreplay.analysis.claims import analyze_dir, summary_lines, write_claims
from kvreplay.core.options import option
from kvreplay.engines import EngineSession, Placement
from kvreplay.engines.placement import MAX_WORKERS, THREADS
from kvreplay.engines.threads import DEFAULT_THREADS
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.run.request import RunRequest

EXPERIMENTS = (
    ("matched", ("bf16", "fp32")),
    ("fixed-prefix", ("bf16", "fp32")),
    ("bridge", ("bf16",)),
)


@dataclass(frozen=True)
class DemoRequest:
    """What ``kvreplay demo`` is asked, declared once (design: every option declared
    once): where it writes, how many items, and the processes and threads it runs on."""

    out: Path = field(
        default=Path("runs/demo"), metadata=option("--out", "Run directory.", output="folder")
    )
    n: int = field(
        default=3, metadata=option("--n", "Items per experiment.", minimum=1, maximum=1000)
    )
    workers: int | None = field(
        default=None,
        metadata=option(
            "--workers",
            "Local worker processes (default: one per core, at most one per row).",
            minimum=1,
            maximum=MAX_WORKERS,
        ),
    )
    threads: int = field(default=DEFAULT_THREADS, metadata=THREADS)


def default_workers(n: int, threads: int) -> int:
    """One worker process per ``threads`` cores this process may use, and no more workers
    than the largest experiment has rows (precisions x items)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = max(len(dtypes) for _, dtypes in EXPERIMENTS) * n
    return max(1, min((cores or 1) // threads, rows))


def run_demo(
    out: Path,
    n: int = 3,
    model: str = DEFAULT_MODEL,
    workers: int | None = None,
    threads: int = DEFAULT_THREADS,
) -> Path:
    """matched and fixed-prefix in bf16 and fp32, the bridge in bf16; return report.html.

    Rows run on ``workers`` local processes (default :func:`default_workers`) of
    ``threads`` torch threads each, which start and load each model once for all three
    experiments; the ledger is the same as a serial run's.
    """
    from kvreplay.report.build import build_report
    from kvreplay.run.runner import run  # the progress bar's library: only once a run starts

    workers = workers or default_workers(n, threads)
    session = EngineSession()
    try:
        for experiment, dtypes in EXPERIMENTS:
            click.echo(
                f"== {experiment} on {model}, {n} items, {'/'.join(dtypes)} "
                f"({workers} worker process{'es' if workers > 1 else ''}, {threads} thread"
                f"{'s' if threads > 1 else ''} each)"
            )
            request = RunRequest(
                experiment=experiment, out=out, model=model, n=n, dtypes=dtypes,
                placement=Placement(workers=workers, threads=threads),
            )  # fmt: skip
            run(request, session=session)
    finally:
        session.close()
    claims = analyze_dir(out)
    write_claims(claims, out / "claims.json")
    for line in summary_lines(claims):
        click.echo(line)
    paths = build_report(out)
    click.echo(f"Report: {paths.html}")
    click.echo(f"Audit it with: kvreplay audit {out}")
    return paths.html
