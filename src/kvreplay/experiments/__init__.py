"""Experiments (design: experiments): one package each, declared once (its
``__init__``'s ``DECLARATION``) and registered by one line in ``registry.py``, which
also holds their tables; what they plug into is :mod:`kvreplay.harness`. Experiment
classes run models, so the registry's names are imported on first use (PEP 562): the
declarations, the typed rows and the CSV declarations load no torch, and ``kvreplay
analyze`` reads them."""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY = ("EXPERIMENTS", "declared", "experiment_at", "get_experiment", "recorded_experiment")


def __getattr__(name: str) -> Any:
    if name not in _REGISTRY:
        raise AttributeError(f"module 'kvreplay.experiments' has no attribute {name!r}")
    return getattr(importlib.import_module("kvreplay.experiments.registry"), name)
