"""Planted engine faults (design: fault): deliberate defects on one code path of a real
engine, planted through the engine's own extension points, to measure which kvreplay
check catches which kind of bug and how fast (``bench/faults.py``: the detection table).

A fault is off unless something outside every run folder turns it on: in a vLLM server
(or any vLLM process), the environment variable ``KVREPLAY_FAULT`` read by kvreplay's
vLLM general plugin, which is registered only by a plugin folder put on that process's
path (:mod:`kvreplay.faults.plugin`); in this process, :func:`planted` (tests, and
``python -m kvreplay.faults NAME -- ARGS``, which runs a kvreplay command with the fault
planted). Nothing in kvreplay's run path imports this package; a run made with a fault
planted records it in its manifest's one field (:mod:`kvreplay.core.planted`) and says
so in its verdict.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvreplay.core.planted import plant, unplant
from kvreplay.faults.patches import install
from kvreplay.faults.registry import ENV, FAULTS, Fault, get

__all__ = ["ENV", "FAULTS", "Fault", "get", "planted"]


@contextmanager
def planted(name: str) -> Iterator[Fault]:
    """The fault planted in this process for the ``with`` block (an in-process engine:
    the hf and llamacpp backends, vLLM's engine core with the vllm backend)."""
    fault = get(name)
    uninstall = install(fault.patches())
    plant(name)
    try:
        yield fault
    finally:
        unplant(name)
        uninstall()
