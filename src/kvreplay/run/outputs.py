"""Where a check writes its verdict (``--json``, ``--junit``) and its repro pack
(``--repro``): each target checked before the run writes anything, written after; and
what a verdict records of the environment it ran in."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvreplay.contract.upgrade import current
from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import replace_file


def write_outputs(
    rendered: tuple[dict[str, Any], str], json_path: Path | None, junit_path: Path | None
) -> None:
    """A verdict's JSON and JUnit XML (``rendered``), each where it was asked for."""
    data, xml = rendered
    for path, text in (
        (json_path, json.dumps(data, indent=2, sort_keys=True) + "\n"),
        (junit_path, xml),
    ):
        if path is None:
            continue
        try:
            replace_file(path, text.encode("utf-8"))
        except OSError as exc:
            raise KvreplayError(f"Cannot write {path} ({exc.strerror or exc}).") from exc


def check_outputs(out: Path, json_path: Path | None, junit_path: Path | None, repro: Path) -> None:
    """Refuse, before the run writes anything, outputs that would overwrite the run or
    each other, or that cannot be written: a path inside the run folder (its ledger,
    items, manifest), the same path twice, a folder where a file goes (or a file where
    the repro pack's folder goes), or a folder that does not exist or is not writable."""
    run = out.resolve()
    named = {"--json": json_path, "--junit": junit_path, "--repro": repro}
    seen: dict[Path, str] = {}
    for flag, path in named.items():
        if path is None:
            continue
        where = path.resolve()
        if where == run or run in where.parents or (flag == "--repro" and where in run.parents):
            raise KvreplayError(
                f"{flag} {path} lies inside the check's run folder {out} (or holds it); "
                "name a path outside it."
            )
        if where in seen:
            raise KvreplayError(f"{flag} and {seen[where]} name the same path {path}.")
        seen[where] = flag
        if flag == "--repro":
            _check_folder_target(path)
        else:
            _check_file_target(flag, path)


def _check_file_target(flag: str, path: Path) -> None:
    if path.exists() and not path.is_file():
        raise KvreplayError(f"{flag} {path} exists and is not a regular file.")
    if path.exists() and not os.access(path, os.W_OK):
        raise KvreplayError(f"{flag} {path} is not writable.")
    parent = path.parent
    if not parent.is_dir():
        raise KvreplayError(f"Cannot write {path}: the folder {parent} does not exist.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvreplayError(f"Cannot write {path}: the folder {parent} is not writable.")


def _check_folder_target(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise KvreplayError(f"--repro {path} exists and is not a folder.")
    existing = path if path.exists() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvreplayError(f"Cannot write the repro pack {path}: {existing} is not writable.")


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
