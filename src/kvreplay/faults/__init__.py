"""Planted engine faults (design: fault): deliberate defects on one code path of a real
engine, planted through the engine's own extension points, to measure which kvreplay
check catches which kind of bug and how fast (``bench/faults.py``: the detection table).

A fault is off unless something outside every run folder turns it on: in a vLLM server
(or any vLLM process), the environment variable ``KVREPLAY_FAULT`` read by kvreplay's
vLLM general plugin, which is registered only by a plugin folder put on that process's
path (:mod:`kvreplay.faults.plugin`); in this process, :func:`planted` (tests, and
``python -m kvreplay.faults NAME -- ARGS``, which runs a kvreplay command with the fault
planted). Nothing in kvreplay's run path imports this package, and a run folder whose
manifest names a fault is refused (:mod:`kvreplay.ledger`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvreplay.faults.patches import Patch, install
from kvreplay.faults.registry import ENV, FAULTS, Fault, get

ENGINE_MODULES = {
    "vllm": "kvreplay.faults.vllm_engine",
    "llamacpp": "kvreplay.faults.llamacpp_engine",
    "hf": "kvreplay.faults.hf_engine",
}

__all__ = ["ENV", "FAULTS", "Fault", "get", "hooks", "planted"]


def hooks(fault: Fault) -> Callable[[], list[Patch]]:
    """What makes the fault's patches (importing its engine)."""
    return importlib.import_module(ENGINE_MODULES[fault.engine]).HOOKS[fault.name]


@contextmanager
def planted(name: str) -> Iterator[Fault]:
    """The fault planted in this process for the ``with`` block (an in-process engine:
    the hf and llamacpp backends, vLLM's engine core with the vllm backend)."""
    fault = get(name)
    uninstall = install(hooks(fault)())
    try:
        yield fault
    finally:
        uninstall()
