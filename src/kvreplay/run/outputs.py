"""Where a check writes its verdict (``--json``, ``--junit``) and its repro pack
(``--repro``): each target checked before the run writes anything
(:class:`kvreplay.core.outputs.Outputs`), written after; and what a verdict records of
the environment it ran in."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvreplay.contract.upgrade import current
from kvreplay.core.outputs import Outputs, check_appendable, check_run_folder, write_output
from kvreplay.ledger import ENGINE_LOG
from kvreplay.run.repro import REPRO_FILES


def check_outputs(
    run: Path, reads: tuple[Path | str | None, ...], json_path: Path | None,
    junit_path: Path | None, repro: Path | None = None, verbose: bool = True,
) -> None:  # fmt: skip
    """Refuse, before the run writes anything, a check's outputs that would overwrite
    what it reads (``reads``: its items, model, plan; the run folder ``run``) or each
    other, or that cannot be written; and (unless ``verbose``) an ``engine.log`` in the
    run folder that is not a regular file of its own."""
    check_run_folder(run, reads)
    outputs = Outputs.reading(*reads, run=run)
    outputs.file("--json", json_path)
    outputs.file("--junit", junit_path)
    outputs.folder("--repro", repro)
    for name in REPRO_FILES if repro is not None and repro.is_dir() else ():
        outputs.file("--repro", repro / name)
    if not verbose:
        check_appendable(run / ENGINE_LOG)


def write_outputs(
    rendered: tuple[dict[str, Any], str], json_path: Path | None, junit_path: Path | None
) -> None:
    """A verdict's JSON and JUnit XML (``rendered``), each where it was asked for."""
    data, xml = rendered
    if json_path is not None:
        write_output(json_path, json_bytes(data))
    if junit_path is not None:
        write_output(junit_path, xml.encode("utf-8"))


def json_bytes(data: Any) -> bytes:
    """A verdict or claims as ``--json`` writes them: strict JSON, which every reader
    parses (a number that is not finite, a k3 KL past float range, say, is written as
    null: ``Infinity`` and ``NaN`` are not JSON)."""
    return (json.dumps(finite(data), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def recorded_environment(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the verdict records of where it ran, from the run's contract (in today's
    layout: its backend named, with its settings)."""
    contract = current(manifest["contract"])
    model = contract["model_info"]
    return {
        "kvreplay_version": manifest.get("kvreplay_version"),
        "model": {"spec": model["spec"], "model_digest": model["model_digest"]},
        "backend": contract["run"]["backend"],
        **contract["environment"],
    }
