"""Engines run units of work and yield their rows in the order given."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvreplay.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.experiments.base import RunConfig


def make_engine(
    config: RunConfig, name: str, workers: int, gpus_per_worker: float, address: str | None
) -> Any:
    """The engine ``run`` and ``audit`` share; Ray is imported only when asked for."""
    if name == "local":
        from kvreplay.engines.local import LocalEngine

        return LocalEngine(config)
    if name == "ray":
        from kvreplay.engines.ray import RayEngine

        return RayEngine(config, workers, gpus_per_worker, address)
    raise KvreplayError(f"Unknown engine {name!r}; choose local or ray.")
