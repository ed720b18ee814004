"""Engines run units of work and yield their rows in the order given: ``local`` in this
process (one worker) or in spawned processes (``--workers N``), ``ray`` on Ray actors."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kvreplay.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.config import RunConfig


def make_engine(
    config: RunConfig, name: str, workers: int, gpus_per_worker: float, address: str | None
) -> Any:
    """The engine ``run`` and ``audit`` share; Ray is imported only when asked for."""
    check_engine(name, workers, gpus_per_worker)
    if name == "local" and workers > 1:
        from kvreplay.engines.processes import ProcessEngine

        return ProcessEngine(config, workers)
    if name == "local":
        from kvreplay.engines.local import LocalEngine

        return LocalEngine(config)
    if name == "ray":
        from kvreplay.engines.ray import RayEngine

        return RayEngine(config, workers, gpus_per_worker, address)
    raise KvreplayError(f"Unknown engine {name!r}; choose local or ray.")


class EngineSession:
    """Engines kept open across runs that ask for the same workers (configuration, engine,
    worker count, threads), so each worker starts and loads its models once: the demo's
    three experiments share one. ``close`` ends them all."""

    def __init__(self) -> None:
        self._engines: list[tuple[tuple[Any, ...], Any]] = []

    def engine(
        self,
        config: RunConfig,
        name: str,
        workers: int,
        gpus_per_worker: float,
        address: str | None,
    ) -> Any:
        """The engine already open for these settings, or a new one."""
        import torch

        key = (config, name, workers, gpus_per_worker, address, torch.get_num_threads())
        for known, engine in self._engines:
            if known == key:
                return engine
        engine = make_engine(config, name, workers, gpus_per_worker, address)
        self._engines.append((key, engine))
        return engine

    def close(self) -> None:
        for _, engine in self._engines:
            engine.close()
        self._engines.clear()


def check_engine(name: str, workers: int, gpus_per_worker: float) -> None:
    """Engine options, refused before a run writes anything."""
    if name not in ("local", "ray"):
        raise KvreplayError(f"Unknown engine {name!r}; choose local or ray.")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise KvreplayError(f"--workers is {workers!r}; it must be an integer of at least 1.")
    if not (math.isfinite(gpus_per_worker) and gpus_per_worker >= 0):
        raise KvreplayError(f"--gpus-per-worker is {gpus_per_worker!r}; it must be 0 or more.")
