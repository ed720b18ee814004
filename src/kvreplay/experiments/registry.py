"""The registry of experiments that ``kvreplay run`` knows: one line per experiment, naming
its declaration (:mod:`kvreplay.experiments.declaration`). A declaration names its classes by
where they live, imported when first asked for: the in-process ones load torch, which the
core install lacks, and a served run needs only the served ones."""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any

from kvreplay.backends import Backend, backend_class, backend_from_contract, load, registry
from kvreplay.core.errors import KvreplayError
from kvreplay.experiments.declaration import Declaration
from kvreplay.experiments.experiment import Experiment

# Every built-in experiment's declaration, one line each, in the order ``kvreplay run
# --help`` lists them; installed packages add theirs through the entry point group.
BUILTIN: tuple[str, ...] = (
    "kvreplay.experiments.matched:DECLARATION",
    "kvreplay.experiments.fixed_prefix:DECLARATION",
    "kvreplay.experiments.bridge:DECLARATION",
    "kvreplay.experiments.transplant:DECLARATION",
    "kvreplay.experiments.resample:DECLARATION",
    "kvreplay.experiments.localize:DECLARATION",
    "kvreplay.experiments.history:DECLARATION",
    "kvreplay.experiments.rollout:DECLARATION",
)
GROUP = "kvreplay.experiments"


@functools.cache
def declared() -> dict[str, Declaration]:
    """Every experiment's declaration by name: the built-in ones, then those installed
    packages register (``[project.entry-points."kvreplay.experiments"]``)."""
    found: dict[str, Declaration] = {}
    for where in (*BUILTIN, *(entry.value for entry in entry_points(group=GROUP))):
        declaration = load(where)
        found.setdefault(declaration.name, declaration)
    return found


def __getattr__(name: str) -> dict[str, str]:
    """``EXPERIMENTS`` and ``SERVED``: where each experiment's class (and served class,
    for a backend without K/V access) lives, by name, from the declarations."""
    if name == "EXPERIMENTS":
        return {key: d.experiment for key, d in declared().items()}
    if name == "SERVED":
        return {key: d.served for key, d in declared().items() if d.served}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def experiment_at(where: str) -> Experiment:
    """The one instance of the experiment class a registry line names."""
    return load(where)()


def get_experiment(
    name: str, backend: Backend | None = None, require_engine: bool = True
) -> Experiment:
    """The experiment ``name`` as ``backend`` runs it (hf when not given); deriving a
    recorded run's CSV needs no engine installed (``require_engine=False``)."""
    experiments = declared()
    if name not in experiments:
        raise KvreplayError(f"Unknown experiment {name!r}; choose {', '.join(experiments)}.")
    declaration = experiments[name]
    if backend is None:
        return experiment_at(declaration.experiment)
    if declaration.needs is not None and declaration.needs not in backend.settings():
        with_it = {b: backend_class(b).settings() for b in registry()}
        with_it = {b: s[declaration.needs] for b, s in with_it.items() if declaration.needs in s}
        flag = next(iter(with_it.values()))["option"]
        raise KvreplayError(
            f"{name} needs {flag}, which the {backend.name} backend does not take; run it "
            f"with --backend {' or '.join(with_it)}."
        )
    served = backend.runs_served(declaration.served is not None)
    if served and declaration.served is None:
        with_kv = [b for b in registry() if backend_class(b).capabilities.kv_access]
        raise KvreplayError(
            f"{name} reads or writes K/V tensors, which the {backend.name} backend does "
            f"not expose; run it with --backend {with_kv[0]} (the {backend.name} backend runs "
            f"{', '.join(sorted(k for k, d in experiments.items() if d.served))})."
        )
    experiment = experiment_at(declaration.served if served else declaration.experiment)
    if backend.traffic_clients and not experiment.panel.under_traffic:
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
