"""Where a run's units run (design: engine): which engine, how many workers, their GPUs, a
Ray cluster to join, and torch threads per worker process. ``kvreplay run``, ``check``
and ``audit`` take the same options, declared once on :class:`Placement`, and every value
is refused before a run writes anything."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import option
from kvreplay.engines.threads import DEFAULT_THREADS, MAX_THREADS

ENGINES = ("local", "ray")
# The most workers an engine starts: each is a process (or Ray actor) holding the model.
MAX_WORKERS = 4096
# How long a Ray address has to accept a connection before it counts as not answering.
RAY_CONNECT_TIMEOUT_S = 5.0


def check_engine(
    name: str, workers: int, gpus_per_worker: float, address: str | None, device: str
) -> None:
    """Engine options, refused before a run writes anything: values out of range, options
    of the Ray engine given to the local one, settings Ray could never place, and a Ray
    address that does not answer (ray.init would wait for minutes, after the manifest)."""
    if name not in ENGINES:
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


THREADS = option(
    "--threads",
    "torch threads per worker process; a resume or audit needs the run's count.",
    minimum=1,
    maximum=MAX_THREADS,
)
"""The ``--threads`` option: a run's placement's, and the demo's (:mod:`kvreplay.demo`)."""


@dataclass(frozen=True)
class Placement:
    """Where units run: ``local`` (this process, or ``workers`` spawned processes) or
    ``ray`` (actors, with GPUs each, on a cluster at ``ray_address``), each worker on
    ``threads`` torch threads (a run's contract records the count)."""

    engine: str = field(
        default="local", metadata=option("--engine", "Where units run.", choices=ENGINES)
    )
    workers: int = field(
        default=1,
        metadata=option(
            "--workers",
            "Worker processes (local: spawned on this machine; ray: actors).",
            minimum=1,
            maximum=MAX_WORKERS,
        ),
    )
    gpus_per_worker: float = field(
        default=0.0,
        metadata=option("--gpus-per-worker", "GPUs per Ray worker.", minimum=0, maximum=64),
    )
    ray_address: str | None = field(
        default=None, metadata=option("--ray-address", "Join this Ray cluster.")
    )
    threads: int = field(default=DEFAULT_THREADS, metadata=THREADS)

    def check(self, device: str) -> None:
        """Refuse what could not run (see :func:`check_engine`)."""
        check_engine(self.engine, self.workers, self.gpus_per_worker, self.ray_address, device)
