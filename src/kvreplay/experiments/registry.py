"""The registry of experiments that ``kvreplay run`` knows, and of the tables they write:
one line per experiment, naming its declaration (:mod:`kvreplay.harness.declaration`).
A declaration states everything about its experiment that another part of kvreplay
asks: its name, classes, tables, section, options, which check it serves and whether a
verdict judges its rows. Its classes are named by where they live and imported when
first asked for: the in-process ones load torch, which the core install lacks, and a
served run needs only the served ones."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvreplay.backends import BACKENDS, Backend, backend_from_contract
from kvreplay.contract.upgrade import current
from kvreplay.core.errors import KvreplayError
from kvreplay.core.registry import Registry, load, located
from kvreplay.experiments.paper.table import HISTORICAL_TABLE, STOCK_TABLE
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.experiment import Experiment
from kvreplay.harness.table import Table, read_header

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
    "kvreplay.experiments.battery:DECLARATION",
    "kvreplay.experiments.rollout:DECLARATION",
    "kvreplay.experiments.weight_update:DECLARATION",
)
EXPERIMENTS: Registry[Declaration] = Registry(
    "experiment", located(BUILTIN, "kvreplay.experiments")
)


def declared() -> dict[str, Declaration]:
    """Every experiment's declaration by name."""
    return dict(EXPERIMENTS.items())


def _tables() -> list[tuple[str, Table]]:
    """Every table: the experiments' (each once: two experiments may share one), then
    the paper release's, which no experiment writes."""
    found: dict[int, tuple[str, Table]] = {}
    for declaration in EXPERIMENTS.values():
        for table in (declaration.table, declaration.served_table):
            if table is not None:
                found.setdefault(id(table), (f"experiment {declaration.name}", table))
    for table in (HISTORICAL_TABLE, STOCK_TABLE):
        found.setdefault(id(table), ("the paper's release", table))
    return list(found.values())


TABLES: Registry[Table] = Registry("table", _tables)


@functools.cache
def experiment_at(where: str, name: str) -> Experiment:
    """The one instance of the experiment class a declaration names (its in-process or
    its served form), made with its declaration."""
    return load(where)(EXPERIMENTS.get(name))


def get_experiment(
    name: str, backend: Backend | None = None, require_engine: bool = True
) -> Experiment:
    """The experiment ``name`` as ``backend`` runs it (in process when not given);
    deriving a recorded run's CSV needs no engine installed (``require_engine=False``)."""
    declaration = EXPERIMENTS.get(name)
    if backend is None:
        return experiment_at(declaration.experiment, name)
    _check_needs(declaration, backend)
    served = backend.runs_served(declaration.served is not None)
    if served and declaration.served is None:
        with_kv = [b for b, cls in BACKENDS.items() if cls.capabilities.kv_access]
        runs = sorted(k for k, d in EXPERIMENTS.items() if d.served)
        raise KvreplayError(
            f"{name} reads or writes K/V tensors, which the {backend.name} backend does "
            f"not expose; run it with --backend {with_kv[0]} (the {backend.name} backend runs "
            f"{', '.join(runs)})."
        )
    experiment = experiment_at(declaration.served if served else declaration.experiment, name)
    if backend.traffic_clients and not experiment.panel.under_traffic:
        raise KvreplayError(
            f"--traffic applies to history; {name} has no arm that runs under traffic."
        )
    if require_engine:
        backend.check_ready()
    return experiment


def _check_needs(declaration: Declaration, backend: Backend) -> None:
    """Refuse a backend without the setting an experiment cannot run without."""
    needs = declaration.needs
    if needs is None or needs in backend.settings():
        return
    takers = {b: cls.settings()[needs] for b, cls in BACKENDS.items() if needs in cls.settings()}
    flag = next(iter(takers.values())).flag
    raise KvreplayError(
        f"{declaration.name} needs {flag}, which the {backend.name} backend does not take; "
        f"run it with --backend {' or '.join(takers)}."
    )


def check_experiment(role: str) -> str:
    """The experiment a check runs in a role (``greedy``, ``faithful``, ``traffic``): the
    one whose declaration says it serves that role."""
    for name, declaration in EXPERIMENTS.items():
        if declaration.check == role:
            return name
    raise KvreplayError(f"No experiment serves a check as {role!r}.")


def outcome_sources() -> tuple[Declaration, ...]:
    """The experiments whose rows record a live (or replay) vs prefill outcome a later
    panel selects on, most preferred first."""
    ranked = [d for d in EXPERIMENTS.values() if d.outcome_rank]
    return tuple(sorted(ranked, key=lambda d: d.outcome_rank or 0))


def judged_experiments() -> tuple[str, ...]:
    """The experiments whose rows a verdict judges (a compared pair of arms)."""
    return tuple(name for name, d in EXPERIMENTS.items() if d.judged)


def experiment_tables() -> dict[str, tuple[Table, Table | None]]:
    """Each experiment's table, and its table as served panels (None: the experiment
    reads or writes K/V, so a backend without K/V access does not run it)."""
    return {name: (d.table, d.served_table) for name, d in EXPERIMENTS.items()}


def table_for(path: Path) -> Table | None:
    """The table a CSV file is read as, or None for any other file; of two tables of one
    file, the one whose marker column the CSV has (a served run's ``backend``)."""
    found = [table for table in TABLES.values() if table.matches(path.name)]
    if any(table.marker for table in found):
        header = read_header(path)
        found = [table for table in found if table.marker in (None, *header)]
    return max(found, key=lambda table: table.marker is not None, default=None)


def _recorded_backend(manifest: dict[str, Any]) -> Backend | None:
    try:
        return backend_from_contract(current(manifest["contract"])["run"]["backend"])
    except (KvreplayError, KeyError, TypeError, AttributeError):
        return None


def recorded_table(name: str, manifest: dict[str, Any]) -> Table | None:
    """The table a run's experiment wrote, as its backend ran it; None if this kvreplay
    cannot derive it (an unknown experiment or backend)."""
    backend = _recorded_backend(manifest)
    if backend is None or name not in EXPERIMENTS:
        return None
    table, served = experiment_tables()[name]
    return served if backend.runs_served(served is not None) else table


def recorded_experiment(name: str, manifest: dict[str, Any]) -> Experiment | None:
    """The experiment a run's manifest recorded, as its backend ran it; None if this
    kvreplay cannot derive it (an unknown name or backend)."""
    backend = _recorded_backend(manifest)
    if backend is None or name not in EXPERIMENTS:
        return None
    try:
        return get_experiment(name, backend, require_engine=False)
    except KvreplayError:
        return None
