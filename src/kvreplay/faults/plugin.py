"""kvreplay's vLLM general plugin (vLLM's ``vllm.general_plugins`` entry point group):
vLLM calls :func:`register` in every process it starts (the API server, the engine core,
its workers), where it plants the vLLM fault ``KVREPLAY_FAULT`` names, if any.

kvreplay's own distribution does not register the plugin: a plugin folder does
(:func:`write_plugin_folder`), a ``*.dist-info`` that declares the entry point, and only
a process whose ``PYTHONPATH`` holds that folder loads it. A user's vLLM never runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvreplay.core.errors import KvreplayError
from kvreplay.core.planted import plant
from kvreplay.faults.patches import install
from kvreplay.faults.registry import ENV, get

GROUP = "vllm.general_plugins"
ENTRY = "kvreplay_fault"
DIST = "kvreplay_fault_plugin-0.dist-info"


def register() -> None:
    """Plant the vLLM fault ``KVREPLAY_FAULT`` names in this process (nothing if unset)."""
    name = os.environ.get(ENV)
    if not name:
        return
    fault = get(name)
    if fault.engine != "vllm":
        raise KvreplayError(f"{ENV}={name} is a {fault.engine} fault, not a vLLM one.")
    install(fault.patches())
    plant(name)
    print(f"kvreplay: planted the fault {name} in process {os.getpid()}", file=sys.stderr)


def write_plugin_folder(folder: Path) -> Path:
    """A folder that, on a process's ``PYTHONPATH``, makes vLLM load :func:`register`."""
    dist = folder / DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvreplay-fault-plugin\nVersion: 0\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(
        f"[{GROUP}]\n{ENTRY} = {__name__}:register\n", encoding="utf-8"
    )
    return folder
