"""Engines run units of work and yield their rows in the order given: ``local`` in this
process (one worker) or in spawned processes (``--workers N``), ``ray`` on Ray actors."""

from __future__ import annotations

import math
import socket
from typing import TYPE_CHECKING, Any

from kvreplay.core.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.run.config import RunConfig


def make_engine(
    config: RunConfig, name: str, workers: int, gpus_per_worker: float, address: str | None
) -> Any:
    """The engine ``run`` and ``audit`` share; Ray is imported only when asked for."""
    check_engine(name, workers, gpus_per_worker, address, config.device)
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


# The most workers an engine starts: each is a process (or Ray actor) holding the model.
MAX_WORKERS = 4096
# How long a Ray address has to accept a connection before it counts as not answering.
RAY_CONNECT_TIMEOUT_S = 5.0


def check_engine(
    name: str,
    workers: int,
    gpus_per_worker: float,
    address: str | None = None,
    device: str = "cpu",
) -> None:
    """Engine options, refused before a run writes anything: values out of range, options
    of the Ray engine given to the local one, settings Ray could never place, and a Ray
    address that does not answer (ray.init would wait for minutes, after the manifest)."""
    if name not in ("local", "ray"):
        raise KvreplayError(f"Unknown engine {name!r}; choose local or ray.")
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise KvreplayError(
            f"--workers is {workers!r}; it must be an integer from 1 to {MAX_WORKERS}."
        )
    if not (math.isfinite(gpus_per_worker) and gpus_per_worker >= 0):
        raise KvreplayError(f"--gpus-per-worker is {gpus_per_worker!r}; it must be 0 or more.")
    if name == "local":
        if address is not None or gpus_per_worker > 0:
            raise KvreplayError(
                "--ray-address and --gpus-per-worker apply only to --engine ray; the local "
                "engine runs on --device."
            )
        return
    check_placement(workers, gpus_per_worker, device, local=address is None)
    if address is not None:
        check_ray_address(address)


def check_placement(workers: int, gpus_per_worker: float, device: str, local: bool) -> None:
    """Refuse Ray settings that cannot do what the user meant: a fraction of GPUs above
    one, GPUs on a CPU run (or none on a CUDA one), and, on a Ray started here, more
    GPUs than this machine has (Ray would wait to place the workers forever)."""
    if gpus_per_worker > 1 and gpus_per_worker != int(gpus_per_worker):
        raise KvreplayError(
            f"--gpus-per-worker is {gpus_per_worker:g}; use a fraction up to 1 or a whole number."
        )
    if device.startswith("cuda") != (gpus_per_worker > 0):
        raise KvreplayError(
            f"--device {device} with --gpus-per-worker {gpus_per_worker:g} does not fit; "
            "give Ray workers GPUs exactly when the device is cuda."
        )
    if local and gpus_per_worker > 0:
        import torch

        per_gpu = max(1, int(1 / gpus_per_worker)) if gpus_per_worker <= 1 else 1
        needed = math.ceil(workers / per_gpu) * max(1, int(gpus_per_worker))
        if needed > torch.cuda.device_count():
            raise KvreplayError(
                f"{workers} Ray workers with {gpus_per_worker:g} GPUs each need {needed} GPUs; "
                f"this machine has {torch.cuda.device_count()}."
            )


def check_ray_address(address: str) -> None:
    """Refuse a Ray address (``host:port`` or ``ray://host:port``; ``auto`` is left to
    Ray) that is malformed or where nothing accepts a connection."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise KvreplayError(f"--ray-address {address!r} is not host:port, ray://host:port or auto.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise KvreplayError(
            f"Nothing answers at the Ray address {address} ({exc.strerror or exc}); start the "
            "cluster or correct --ray-address."
        ) from exc
