"""Engines run units of work and yield their rows in the order given: ``local`` in this
process (one worker) or in spawned processes (``--workers N``), ``ray`` on Ray actors;
which one, and how many workers, is a :class:`~kvreplay.engines.placement.Placement`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvreplay.engines.placement import Placement

if TYPE_CHECKING:
    from kvreplay.contract.config import RunConfig


def make_engine(
    config: RunConfig, placement: Placement, environment: dict[str, str] | None = None
) -> Any:
    """The engine ``run`` and ``audit`` share; Ray is imported only when asked for.
    ``environment``: variables the workers must start with (an audit's pin of torch's
    kernels), which puts even one worker in a process of its own."""
    placement.check(config.device)
    if placement.engine == "ray":
        from kvreplay.engines.ray import RayEngine

        return RayEngine(config, placement)
    if placement.workers > 1 or environment:
        from kvreplay.engines.processes import ProcessEngine

        return ProcessEngine(config, placement.workers, environment or {})
    from kvreplay.engines.local import LocalEngine

    return LocalEngine(config)


class EngineSession:
    """Engines kept open across runs that ask for the same workers (configuration, engine,
    worker count, threads), so each worker starts and loads its models once: the demo's
    three experiments share one. ``close`` ends them all."""

    def __init__(self) -> None:
        self._engines: list[tuple[tuple[Any, ...], Any]] = []

    def engine(self, config: RunConfig, placement: Placement) -> Any:
        """The engine already open for these settings, or a new one."""
        key = (config, placement)
        for known, engine in self._engines:
            if known == key:
                return engine
        engine = make_engine(config, placement)
        self._engines.append((key, engine))
        return engine

    def close(self) -> None:
        for _, engine in self._engines:
            engine.close()
        self._engines.clear()


__all__ = ["EngineSession", "Placement", "make_engine"]
