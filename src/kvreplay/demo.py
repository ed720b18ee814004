"""``make demo`` / ``kvreplay demo``: the three paper experiments on the embedded default
model at a size that finishes in minutes on a laptop CPU, then claims and a report."""

from __future__ import annotations

from pathlib import Path

import click

from kvreplay.analysis.claims import analyze_dir, summary_lines, write_claims
from kvreplay.models import DEFAULT_MODEL
from kvreplay.runner import RunRequest, run


def run_demo(out: Path, n: int = 3, model: str = DEFAULT_MODEL) -> Path:
    """matched and fixed-prefix in bf16 and fp32, the bridge in bf16; return report.html."""
    from kvreplay.report import build_report

    for experiment, dtypes in (
        ("matched", ("bf16", "fp32")),
        ("fixed-prefix", ("bf16", "fp32")),
        ("bridge", ("bf16",)),
    ):
        click.echo(f"== {experiment} on {model}, {n} items, {'/'.join(dtypes)}")
        run(RunRequest(experiment=experiment, out=out, model=model, n=n, dtypes=dtypes))
    claims = analyze_dir(out)
    write_claims(claims, out / "claims.json")
    for line in summary_lines(claims):
        click.echo(line)
    paths = build_report(out)
    click.echo(f"Report: {paths.html}")
    click.echo(f"Audit it with: kvreplay audit {out}")
    return paths.html
