"""A check's repro pack (design: check): for its first item that fails the expectation,
everything needed to see and reproduce the divergence without the run folder, and the
one command that reproduces it (the check itself, narrowed to that item)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.core.items import load_jsonl
from kvreplay.core.outputs import write_output
from kvreplay.harness.experiment import Experiment
from kvreplay.harness.rows import PanelRow
from kvreplay.ledger import ITEMS, Record
from kvreplay.verify.outcome import ItemOutcome
from kvreplay.verify.render import SCHEMA
from kvreplay.verify.verdict import Verdict

REPRO_FILES = ("item.jsonl", "repro.json")  # what a pack's folder holds


@dataclass(frozen=True)
class ReproPack:
    """A written repro pack: its folder and the command that reproduces its item."""

    folder: Path
    command: str


def repro_pack(
    folder: Path,
    verdict: Verdict,
    run_dir: Path,
    rows: list[Record],
    experiment: Experiment,
    rerun: Callable[[Path, Path, str], list[str]],
) -> ReproPack | None:
    """For the first item that fails the expectation (its suffixes, or under
    ``bitwise`` its numerics, part): its item line, P, both suffixes, where tokens and
    numerics part, the margins and first-step logprobs, the environment, and the one
    command that reproduces it: ``rerun(item file, folder, precision)``, this check on
    that item alone."""
    first = next((o for o in verdict.items if o.reached and not verdict.passes(o)), None)
    if first is None:
        return None
    record = next(
        r for r in rows if r.data.get("item_id") == first.item_id
        and r.data.get("precision") == first.precision and r.data.get("kind") != "prefix"
    )  # fmt: skip
    row = experiment.read_row(record.data)
    folder.mkdir(parents=True, exist_ok=True)
    item_line, pack_file = (folder / name for name in REPRO_FILES)
    item = next(i for i in load_jsonl(run_dir / ITEMS) if i.id == first.item_id)
    write_output(item_line, (json.dumps(item.to_dict(), sort_keys=True) + "\n").encode())
    command = rerun(item_line, folder / "rerun", first.precision)
    pack = _pack(verdict, first, row, shlex.join(command))
    write_output(pack_file, (json.dumps(pack, indent=2, sort_keys=True) + "\n").encode())
    return ReproPack(folder, pack["command"])


def _pack(verdict: Verdict, first: ItemOutcome, row: PanelRow, command: str) -> dict[str, Any]:
    """repro.json: what parted, where, how narrowly, and in which environment."""
    left, right = row.pairs[0]
    prefix = row.prefix
    return {
        "schema": SCHEMA + "-repro",
        "item_id": first.item_id,
        "precision": first.precision,
        "prompt_token_ids": prefix["prefix_token_ids"][: prefix["prompt_token_count"]],
        "prefix_token_ids": prefix["prefix_token_ids"],
        "compared": list(verdict.compared),
        "suffixes": {
            verdict.compared[0]: left.suffix_token_ids,
            verdict.compared[1]: right.suffix_token_ids,
        },  # fmt: skip
        "first_divergence": first.first_divergence,
        "numeric_divergence": first.numeric_step,
        "bits": first.bits,
        "margins_at_divergence": {
            verdict.compared[0]: first.left_margin,
            verdict.compared[1]: first.right_margin,
        },  # fmt: skip
        "first_step_logprobs": {
            name: arm.served.first_logprobs
            for name, arm in zip(verdict.compared, (left, right), strict=True)
            if arm.served is not None
        },
        "environment": verdict.environment,
        "command": command,
    }
