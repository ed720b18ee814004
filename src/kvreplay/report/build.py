"""The report's files: report.md beside figures/*.png, and report.html with the figures
embedded; the claims come from the run's claims.json, or from a fresh analysis."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvreplay.analysis.claims import SCHEMA, Claims, build_claims, write_claims
from kvreplay.analysis.ledgers import LedgerDir, load_ledger_dir
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.outputs import write_output
from kvreplay.core.paths import read_regular
from kvreplay.harness.table import LedgerError
from kvreplay.render.document import Image, to_html, to_markdown
from kvreplay.render.figures import Figures
from kvreplay.report.sections import report_blocks

MAX_CLAIMS_BYTES = 64 * 2**20  # claims take a few kB
REPORT_FILES = ("report.md", "report.html")
FIGURES = "figures"


@dataclass(frozen=True)
class ReportPaths:
    """Where build_report wrote its outputs."""

    markdown: Path
    html: Path
    figures: tuple[Path, ...]


def _load_claims(run_dir: Path, folder: LedgerDir, out_dir: Path) -> Claims:
    """The run's claims.json, or a fresh analysis written to out_dir when there is none."""
    path = run_dir / "claims.json"
    if not path.is_file():
        claims = build_claims(folder)
        write_claims(claims, out_dir / "claims.json")
        return claims
    try:
        data = parse_json(read_regular(path, MAX_CLAIMS_BYTES))
    except OSError as error:
        raise LedgerError("claims.json", f"it cannot be read ({error.strerror})") from None
    except JsonError as error:
        raise LedgerError("claims.json", f"it is not valid JSON ({error})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise LedgerError("claims.json", f"its schema is not {SCHEMA}", field="schema")
    return Claims.from_json(data)


def build_report(
    run_dir: Path, out_dir: Path | None = None, claims: Claims | None = None
) -> ReportPaths:
    """Write report.md, report.html and figures/*.png for a run (or any folder of ledgers).

    out_dir defaults to run_dir; pass another folder when run_dir is read-only. The
    claims are the run's claims.json unless given (an audit gives its re-derivation).
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    folder = load_ledger_dir(run_dir)
    figures = Figures(out_dir / FIGURES)
    figures.folder.mkdir(parents=True, exist_ok=True)
    claims = claims or _load_claims(run_dir, folder, out_dir)
    blocks = report_blocks(run_dir, claims, folder, figures)
    markdown, page = (out_dir / name for name in REPORT_FILES)
    write_output(markdown, to_markdown(blocks, out_dir).encode("utf-8"))
    write_output(page, to_html(blocks).encode("utf-8"))
    images = tuple(block.path for block in blocks if isinstance(block, Image))
    return ReportPaths(markdown, page, images)
