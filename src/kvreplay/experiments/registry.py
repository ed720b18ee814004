"""The registry of experiments that ``kvreplay run`` knows (they load torch)."""

from __future__ import annotations

from typing import Any

from kvreplay.backends import Backend, backend_class, backend_from_contract, registry
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


# The experiments a serving engine runs as served panels (a backend without K/V access
# runs only these).
SERVED: dict[str, Experiment] = {e.name: e for e in (ServedMatched(), ServedResample())}


def get_experiment(
    name: str, backend: Backend | None = None, require_engine: bool = True
) -> Experiment:
    """The experiment ``name`` as ``backend`` runs it (hf when not given); deriving a
    recorded run's CSV needs no engine installed (``require_engine=False``)."""
    if name not in EXPERIMENTS:
        raise KvreplayError(f"Unknown experiment {name!r}; choose {', '.join(EXPERIMENTS)}.")
    if backend is None:
        return EXPERIMENTS[name]
    served = backend.runs_served(name in SERVED)
    if served and name not in SERVED:
        with_kv = [b for b in registry() if backend_class(b).capabilities.kv_access]
        raise KvreplayError(
            f"{name} reads or writes K/V tensors, which the {backend.name} backend does "
            f"not expose; run it with --backend {with_kv[0]} (the {backend.name} backend runs "
            f"{', '.join(sorted(SERVED))})."
        )
    if require_engine:
        backend.check_ready()
    return SERVED[name] if served else EXPERIMENTS[name]


def recorded_experiment(name: str, manifest: dict[str, Any]) -> Experiment | None:
    """The experiment a run's manifest recorded, as its backend ran it; None if this
    kvreplay cannot derive it (an unknown name or backend)."""
    run = manifest.get("contract", {}).get("run")
    try:
        backend = backend_from_contract(run.get("backend") if isinstance(run, dict) else None)
        return get_experiment(name, backend, require_engine=False)
    except (KvreplayError, KeyError, TypeError):
        return None
