"""The report's blocks in reading order, before any rendering: the run's facts, the
headline beside the paper (each analysis section's rows), then each analysis section's
own blocks (``analysis/sections``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvreplay.analysis.claims import Claims
from kvreplay.analysis.ledgers import LedgerDir
from kvreplay.analysis.sections.registry import sections
from kvreplay.backends import backend_class
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import parse_json
from kvreplay.harness.section import Page
from kvreplay.harness.table import LedgerError
from kvreplay.ledger import Record, rows_of
from kvreplay.render.document import Block, Heading, Paragraph, Table
from kvreplay.render.figures import Figures


def _manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run's manifest, or None for a bare folder of ledgers."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        return parse_json(path.read_bytes())
    except (OSError, ValueError) as error:
        raise LedgerError("manifest.json", f"it is not a kvreplay run manifest ({error})") from None


def _title(manifest: dict[str, Any] | None, folder: LedgerDir) -> str:
    """What the report is about, from the run's files alone: never the folder's name, so
    that a run moved or copied elsewhere derives the same report."""
    if manifest is None:
        return "kvreplay report: " + ", ".join(sorted(folder.ledgers))
    experiments = ", ".join(manifest.get("experiments", {})) or "no experiment"
    return f"kvreplay report: {experiments} on {manifest['contract']['model_info']['spec']}"


def _manifest_rows(manifest: dict[str, Any]) -> list[tuple[str, ...]]:
    """The facts a reader needs to judge a run: model, precision contract, machine, items;
    a manifest that does not hold them is refused (one sentence), never a traceback."""
    try:
        return _facts(manifest)
    except (KeyError, TypeError, AttributeError, IndexError) as error:
        raise LedgerError(
            "manifest.json", f"it is not a kvreplay run manifest ({error!r})"
        ) from None


def _facts(manifest: dict[str, Any]) -> list[tuple[str, ...]]:
    contract = manifest["contract"]
    model, env, run = contract["model_info"], contract["environment"], contract["run"]
    threads = f", {env['threads']} threads" if "threads" in env else ""
    libraries = [f"{k} {env[k]}" for k in ("torch", "transformers", "tokenizers") if k in env]
    torch = "dtype_contract" in env
    engines = {
        name: entry.get("engine", {}).get("engine", "?")
        for name, entry in manifest.get("experiments", {}).items()
    }
    return [
        ("model", f"{model['spec']} ({model['model_type']}, {model['num_layers']} layers)"),
        ("model digest", model["model_digest"]),
        ("stage plan", run["plan"]["name"] + ", boundary after " + run["plan"]["boundary_stage"]),
        (
            "items",
            f"{contract['items']['source']} ({contract['items']['count']} items, "
            f"digest {contract['items']['digest'][:16]}…)",
        ),
        # A core install (no torch) records no threads, torch or dtype contract.
        ("device", f"{env['device']} ({env['device_name']})" + threads),
        ("versions", ", ".join([*libraries, f"python {env['python']}"])),
        *([("dtype contract", json.dumps(env["dtype_contract"], sort_keys=True))] if torch else []),
        *(
            [
                (
                    "backend",
                    f"{run['backend']['name']} {_backend_version(run['backend'], env)}, "
                    + json.dumps(run["backend"], sort_keys=True),
                )
            ]
            if "backend" in run
            else []
        ),
        ("experiments", ", ".join(f"{k} ({v})" for k, v in engines.items())),
        ("kvreplay", f"{manifest.get('kvreplay_version')} at {manifest.get('git_commit') or '?'}"),
    ]


def _backend_version(recorded: dict[str, Any], environment: dict[str, Any]) -> str:
    """What ran the rows, as the recorded backend names it (``?`` for one not installed)."""
    try:
        return backend_class(recorded["name"]).version(recorded, environment)
    except KvreplayError:
        return "?"


def report_blocks(
    run_dir: Path, claims: Claims, folder: LedgerDir, figures: Figures
) -> list[Block]:
    """The report's content, independent of its Markdown or HTML rendering."""
    manifest = _manifest(run_dir)
    facts = _manifest_rows(manifest) if manifest is not None else None  # checks its fields
    blocks: list[Block] = [Heading(_title(manifest, folder)), Heading("Run")]
    if facts is not None:
        blocks.append(Table(("field", "value"), facts))
    else:
        blocks.append(Paragraph("No manifest.json here, so model, engine and device are unknown."))
    blocks.append(Paragraph("Ledgers read: " + ", ".join(sorted(folder.ledgers)) + "."))
    present = [(s, part) for s in sections() if (part := claims.of(s)) is not None]
    headline = [row for section, part in present for row in section.headline(part)]
    if headline:  # a run of experiments the paper has no figure for has none
        blocks += [
            Heading("Headline, beside the paper"),
            Paragraph(
                "The paper column quotes the stage-replay paper's published figures"
                " (arXiv 2607.28495); a run on another model or item set is not expected to"
                " match."
            ),
            Table(("claim", "this run", "paper"), headline),
        ]
    blocks += _verdicts(run_dir, folder.records)
    for section, part in present:
        own = section.ledgers(folder.ledgers)
        blocks += section.report(Page(part, own, folder.records, figures))
    return blocks


def _verdicts(run_dir: Path, records: Iterable[Record] | None) -> list[Block]:
    """Each experiment's closing verdict, as ``kvreplay run`` printed it: both levels,
    the near-ties and the power (a folder of CSVs alone has no rows to judge)."""
    if not records:
        return []
    from kvreplay.experiments.registry import judged_experiments, recorded_experiment
    from kvreplay.verify.render import run_sentence

    manifest = parse_json((run_dir / "manifest.json").read_bytes())
    found = []
    for name, entry in manifest.get("experiments", {}).items():
        experiment = recorded_experiment(name, manifest)
        rows = rows_of(records, name)
        if experiment is None or next(iter(rows), None) is None or name not in judged_experiments():
            continue
        sentence = run_sentence(experiment, rows, entry["config"].get("margin"))
        found.append(Paragraph(f"{name}: {sentence}"))
    return [Heading("Verdict"), *found] if found else []
