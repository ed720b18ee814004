"""Experiments (design: experiments): each declared once (``declaration.py``) and registered
by one line in ``registry.py``; a new one is one package (see ``localize/``). Experiment
classes run models, so the registry's names are imported on first use (PEP 562): the
declarations, the typed rows and the CSV declarations in this package load no torch, and
``kvreplay analyze`` reads them."""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY = ("EXPERIMENTS", "declared", "experiment_at", "get_experiment", "recorded_experiment")


def __getattr__(name: str) -> Any:
    if name not in _REGISTRY:
        raise AttributeError(f"module 'kvreplay.experiments' has no attribute {name!r}")
    return getattr(importlib.import_module("kvreplay.experiments.registry"), name)
