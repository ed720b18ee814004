"""``kvreplay env RUN --venv DIR``: build the environment a run was made in, from the exact
pins it recorded (:func:`kvreplay.contract.lock.run_environment`), into a folder checked
before anything runs."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from kvreplay.contract.lock import run_environment
from kvreplay.core.errors import KvreplayError
from kvreplay.core.outputs import in_system_folder, target_problem
from kvreplay.core.paths import check_name


def check_venv(venv: str) -> Path:
    """The folder ``kvreplay env --venv`` builds, as an absolute path; refused in one
    sentence: nothing (the current folder), an option, a name with control characters,
    a system folder, a file, a symbolic link, or a folder that holds anything, a virtual
    environment included: kvreplay runs only an environment it creates in that call (a
    ``.pth`` file in one it did not create would run as its Python starts)."""
    if not venv.strip():
        raise KvreplayError("--venv is empty; name the folder to build, e.g. --venv .venv-run.")
    if not venv.isprintable():
        raise KvreplayError("--venv holds a newline or another control character.")
    if venv.startswith("-"):
        raise KvreplayError(
            f"--venv {venv[:80]!r} starts with '-', which would reach python -m venv as an "
            f"option; write ./{venv[:80]} for a folder of that name."
        )
    target = check_name(Path(venv), "--venv").absolute()
    shown = f"--venv {venv[:80]!r}"
    system = in_system_folder(target)
    if system is not None:
        raise KvreplayError(f"{shown} is inside {system}, which holds no files to build in.")
    problem = target_problem(target, folder=True)  # a link, a file, a device, a FIFO
    if problem is not None:
        raise KvreplayError(f"{shown} {problem}; name a new folder.")
    if target.is_dir() and any(target.iterdir()):
        raise KvreplayError(
            f"{shown} is a folder that already holds files; kvreplay builds only a new or "
            "empty folder and runs nothing it did not create there, so name a new folder."
        )
    return target


def rebuild(manifest: dict[str, Any], venv: str, echo: Any) -> None:
    """Build ``venv`` with the run's environment, echoing each command before it runs.
    Both the folder and every pin are checked before anything runs."""
    target = check_venv(venv)
    for command in run_environment(manifest).commands(target):
        echo("$ " + shlex.join(command))
        try:
            done = subprocess.run(command, check=False)
        except OSError as exc:
            raise KvreplayError(f"Could not run {command[0]} ({exc.strerror}).") from exc
        if done.returncode != 0:
            raise KvreplayError(
                f"Rebuilding the run's environment failed at: {shlex.join(command)}."
            )
