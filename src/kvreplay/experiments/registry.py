"""The registry of experiments that ``kvreplay run`` knows, each named by where its class
lives and imported when first asked for: the in-process ones load torch, which the core
install lacks, and a served run needs only the served ones."""

from __future__ import annotations

import functools
from typing import Any

from kvreplay.backends import Backend, backend_class, backend_from_contract, load, registry
from kvreplay.errors import KvreplayError
from kvreplay.experiments.experiment import Experiment

EXPERIMENTS: dict[str, str] = {
    "matched": "kvreplay.experiments.matched:Matched",
    "fixed-prefix": "kvreplay.experiments.fixed_prefix:FixedPrefix",
    "bridge": "kvreplay.experiments.bridge:Bridge",
    "transplant": "kvreplay.experiments.transplant:Transplant",
    "resample": "kvreplay.experiments.resample:Resample",
    "localize": "kvreplay.experiments.localize:Localize",
    "history": "kvreplay.experiments.history:History",
}


# The experiments a backend without K/V access runs, declared as served panels.
SERVED: dict[str, str] = {
    "matched": "kvreplay.experiments.matched:ServedMatched",
    "resample": "kvreplay.experiments.resample:ServedResample",
    "history": "kvreplay.experiments.history:History",
}


@functools.cache
def experiment_at(where: str) -> Experiment:
    """The one instance of the experiment class a registry line names."""
    return load(where)()


def get_experiment(
    name: str, backend: Backend | None = None, require_engine: bool = True
) -> Experiment:
    """The experiment ``name`` as ``backend`` runs it (hf when not given); deriving a
    recorded run's CSV needs no engine installed (``require_engine=False``)."""
    if name not in EXPERIMENTS:
        raise KvreplayError(f"Unknown experiment {name!r}; choose {', '.join(EXPERIMENTS)}.")
    if backend is None:
        return experiment_at(EXPERIMENTS[name])
    served = backend.runs_served(name in SERVED)
    if served and name not in SERVED:
        with_kv = [b for b in registry() if backend_class(b).capabilities.kv_access]
        raise KvreplayError(
            f"{name} reads or writes K/V tensors, which the {backend.name} backend does "
            f"not expose; run it with --backend {with_kv[0]} (the {backend.name} backend runs "
            f"{', '.join(sorted(SERVED))})."
        )
    experiment = experiment_at(SERVED[name] if served else EXPERIMENTS[name])
    if backend.traffic_clients and not any(
        getattr(arm, "traffic", False) for arm in experiment.panel.arms
    ):
        raise KvreplayError(
            f"--traffic applies to history; {name} has no arm that runs under traffic."
        )
    if require_engine:
        backend.check_ready()
    return experiment


def recorded_experiment(name: str, manifest: dict[str, Any]) -> Experiment | None:
    """The experiment a run's manifest recorded, as its backend ran it; None if this
    kvreplay cannot derive it (an unknown name or backend)."""
    run = manifest.get("contract", {}).get("run")
    try:
        backend = backend_from_contract(run.get("backend") if isinstance(run, dict) else None)
        return get_experiment(name, backend, require_engine=False)
    except (KvreplayError, KeyError, TypeError):
        return None
