"""The `analyze` and `report` click commands; the main CLI group registers them.

Bad input ends in one plain sentence on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvreplay.analysis.claims import analyze_dir, summary_lines, write_claims
from kvreplay.core.errors import KvreplayError, plain_errors
from kvreplay.core.outputs import Inputs, check_file_target, check_folder_target
from kvreplay.core.paths import name_problem, shown_path


class UserPath(click.Path):
    """A ``click.Path`` that refuses an empty value (``Path("")`` is the current folder)
    and a path the file system cannot hold, as a usage error."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty; name a path (. is the current folder)", param, ctx)
        problem = name_problem(Path(value))
        if problem:
            self.fail(f"{shown_path(value)} cannot be used: {problem}", param, ctx)
        return super().convert(value, param, ctx)


class OutputPath(UserPath):
    """A path a command writes, a ``file`` or a ``folder`` (design: output writer): the
    type marks it, so that every output option of every command can be found from the
    command line itself (the output writer, :mod:`kvreplay.core.outputs`, checks it
    before any work). ``named`` keeps the text as given, for a command that checks the
    name itself (``env --venv`` refuses a name starting with ``-`` before anything)."""

    def __init__(self, kind: str, named: bool = False) -> None:
        super().__init__(path_type=Path, dir_okay=kind != "file", file_okay=kind != "folder")
        self.kind, self.named = kind, named

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if self.named else super().convert(value, param, ctx)


def output_option(name: str, help: str, kind: str) -> Callable[[Any], Any]:
    """``-o``: where a command writes; by default, inside the folder it reads."""
    return click.option("-o", name, type=OutputPath(kind), default=None, help=help)


@click.command()
@click.argument("ledger_dir", type=UserPath(path_type=Path))
@output_option(
    "--output", "Where to write the claims JSON (default: LEDGER_DIR/claims.json).", "file"
)
@plain_errors
def analyze(ledger_dir: Path, output: Path | None) -> None:
    """Validate the CSV ledgers in LEDGER_DIR and write the paper-schema claims JSON."""
    output = output or ledger_dir / "claims.json"
    inputs = Inputs()
    inputs.add_files(ledger_dir, but=("claims.json",))  # it reads the rest
    check_file_target("-o", output, inputs)
    claims = analyze_dir(ledger_dir)
    write_claims(claims, output)
    for line in summary_lines(claims):
        click.echo(line)
    click.echo(f"wrote {output}")


@click.command()
@click.argument("run_dir", type=UserPath(path_type=Path))
@output_option(
    "--out-dir",
    "Folder for report.md, report.html and figures/ (default: RUN_DIR).",
    "folder",
)
@plain_errors
def report(run_dir: Path, out_dir: Path | None) -> None:
    """Write report.md, a self-contained report.html and figures/ for RUN_DIR."""
    from kvreplay.report.build import FIGURES, REPORT_FILES, build_report  # loads matplotlib

    target = out_dir or run_dir.resolve()
    check_folder_target("--out-dir", target, Inputs())
    if target.is_dir():  # the names it replaces there, each a file or folder of its own
        for name in REPORT_FILES:
            check_file_target("--out-dir", target / name, Inputs())
        check_folder_target("--out-dir", target / FIGURES, Inputs())
    try:
        paths = build_report(run_dir, out_dir)
    except OSError as error:
        raise KvreplayError(f"cannot write the report: {error.strerror or error}.") from error
    click.echo(f"wrote {paths.html}")
