"""The registry of experiments that ``kvreplay run`` knows."""

from __future__ import annotations

from typing import Any

from kvreplay.backends import Backend, check_backend
from kvreplay.errors import KvreplayError
from kvreplay.experiments.bridge import Bridge
from kvreplay.experiments.experiment import Experiment
from kvreplay.experiments.fixed_prefix import FixedPrefix
from kvreplay.experiments.localize import Localize
from kvreplay.experiments.matched import Matched, ServedMatched
from kvreplay.experiments.resample import Resample, ServedResample
from kvreplay.experiments.transplant import Transplant

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e for e in (Matched(), FixedPrefix(), Bridge(), Transplant(), Resample(), Localize())
}


# The experiments a backend without K/V access runs, declared as served panels.
SERVED: dict[str, Experiment] = {e.name: e for e in (ServedMatched(), ServedResample())}


def get_experiment(
    name: str, backend: Backend | None = None, require_engine: bool = True
) -> Experiment:
    """The experiment ``name`` as ``backend`` runs it (hf when not given); deriving a
    recorded run's CSV needs no engine installed (``require_engine=False``)."""
    if name not in EXPERIMENTS:
        raise KvreplayError(f"Unknown experiment {name!r}; choose {', '.join(EXPERIMENTS)}.")
    if backend is None or backend.kv_access:
        return EXPERIMENTS[name]
    check_backend(backend, name, frozenset(SERVED), require_engine)
    return SERVED[name]


def recorded_experiment(name: str, manifest: dict[str, Any]) -> Experiment | None:
    """The experiment a run's manifest recorded, as its backend ran it; None if this
    kvreplay cannot derive it (an unknown name or backend)."""
    run = manifest.get("contract", {}).get("run")
    try:
        backend = Backend.from_contract(run.get("backend") if isinstance(run, dict) else None)
        return get_experiment(name, backend, require_engine=False)
    except (KvreplayError, KeyError, TypeError):
        return None
