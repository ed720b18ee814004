"""The Ray engine: the same units on a pool of Ray Core actors, rows in the same order.

Each actor wraps one :class:`~kvreplay.engines.worker.Worker`, so it runs exactly the
code the local engine runs and loads each precision's model once. Units are handed to
whichever actor is idle (ActorPool-style); the driver alone writes rows, so completions
that arrive early are buffered and yielded in the order of ``units`` as soon as they are
next. An actor that dies is restarted by Ray and its in-flight unit is handed out again;
a unit is yielded once, from the one result the driver accepted.

This is the only module that imports ``ray``, and only when a RayEngine is built.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.engines.placement import Placement, check_placement
from kvreplay.engines.worker import Worker
from kvreplay.harness.units import Unit
from kvreplay.model.embedded import cache_root

# Ray restarts a dead actor this many times before the engine gives it up.
MAX_RESTARTS = 3
# A unit that was in flight on this many dying workers is taken to be their cause.
MAX_ATTEMPTS = 3
# How long to wait for Ray to place every worker (an autoscaling cluster may first have
# to start nodes) before declaring the cluster too small.
PLACEMENT_TIMEOUT_S = 600.0
# Driver variables the workers need to find the same model files and stay offline.
FORWARDED_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

# Whether kvreplay started the process's Ray, and how many engines still use it.
_owned_ray = False
_live_engines = 0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise KvreplayError(
            "The Ray engine needs Ray; install it with: pip install 'kvreplay[ray]'."
        ) from exc
    return ray


def worker_env() -> dict[str, str]:
    """Environment for the actors: the driver's model cache and hub settings.

    Actors on a joined cluster do not inherit the driver's environment, and a local Ray
    started earlier (e.g. by a test session) holds an older one.
    """
    env = {"KVREPLAY_CACHE": str(cache_root())}
    env.update({name: os.environ[name] for name in FORWARDED_ENV if name in os.environ})
    return env


class RayWorker:
    """The body of one actor: a kvreplay Worker, plus an optional crash for tests.

    The actor uses the driver's CPU thread count (the run's contract records it): Ray
    would default it to one, and a CPU matmul's result can depend on how many threads
    split it.
    ``crash_on_unit`` is a test hook: when set, the actor's process exits abruptly as it
    starts that (1-based) unit, once; the actor Ray restarts in its place runs normally.
    """

    def __init__(
        self,
        config: RunConfig,
        name: str,
        device_map: str | None,
        threads: int,
        crash_on_unit: int | None = None,
    ):
        torch.set_num_threads(threads)
        self.worker = Worker(config, name, device_map)
        self.crash_on_unit = crash_on_unit
        self.units_started = 0

    def device_info(self) -> dict[str, Any]:
        """The Worker's device plus where Ray placed it (node, GPUs, threads)."""
        import ray

        context = ray.get_runtime_context()
        return {
            **self.worker.device_info(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
            "threads": torch.get_num_threads(),
        }

    def run(self, unit: Unit) -> tuple[dict[str, Any], dict[str, float]]:
        self.units_started += 1
        if self.units_started == self.crash_on_unit:
            import ray

            if not ray.get_runtime_context().was_current_actor_reconstructed:
                os._exit(1)
        return self.worker.run(unit)


def _start_ray(ray: Any, address: str | None, cpus: int) -> None:
    """Start Ray in this process (``cpus`` CPUs, no dashboard) or join it at ``address``."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
    else:
        ray.init(address=address)


class RayEngine:
    """Runs units on ``workers`` Ray actors with ``gpus_per_worker`` GPUs each."""

    name = "ray"

    def __init__(
        self,
        config: RunConfig,
        placement: Placement,
        fault_injection: dict[str, int] | None = None,
    ):
        """Start (or join, or reuse) Ray and place every actor before returning.

        ``fault_injection`` maps a worker name to the unit on which that actor crashes
        once (see :class:`RayWorker`); it exists for the crash-recovery test.
        """
        global _owned_ray, _live_engines
        workers, gpus_per_worker = placement.workers, placement.gpus_per_worker
        address = placement.ray_address
        check_placement(workers, gpus_per_worker, config.device, local=address is None)
        threads = torch.get_num_threads()
        # A CPU worker reserves a core per thread, so Ray never packs more threads than
        # cores on a node (oversubscribed OpenMP threads spin and run many times slower).
        cpus_per_worker = 1 if gpus_per_worker > 0 else threads
        ray = _import_ray()
        self._ray = ray
        if not ray.is_initialized():
            _start_ray(ray, address, max(os.cpu_count() or 1, workers * cpus_per_worker))
            _owned_ray = True
        _live_engines += 1
        self._closed = False
        self.address = ray.get_runtime_context().gcs_address
        actor_class = ray.remote(RayWorker).options(
            num_cpus=cpus_per_worker,
            num_gpus=gpus_per_worker,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,  # the driver re-dispatches, to whichever actor is idle
            runtime_env={"env_vars": worker_env()},
        )
        device_map = "auto" if gpus_per_worker > 1 else None
        faults = fault_injection or {}
        self.names = [f"ray-{i}" for i in range(workers)]
        self.actors = [
            actor_class.remote(config, name, device_map, threads, faults.get(name))
            for name in self.names
        ]
        self.retries = 0
        self.devices = self._placed(f"{cpus_per_worker} CPUs and {gpus_per_worker:g} GPUs each")

    def _placed(self, each: str) -> list[Any]:
        """Every actor's device, once Ray has placed them all (else closed, one sentence)."""
        ray = self._ray
        try:
            return list(
                ray.get([a.device_info.remote() for a in self.actors], timeout=PLACEMENT_TIMEOUT_S)
            )
        except ray.exceptions.GetTimeoutError as exc:
            self.close()
            raise KvreplayError(
                f"Ray could not place {len(self.actors)} workers ({each}) within "
                f"{PLACEMENT_TIMEOUT_S:g} s; check the cluster's free resources."
            ) from exc
        except ray.exceptions.RayError as exc:
            self.close()
            raise KvreplayError(f"The Ray workers failed to start ({first_line(exc)}).") from exc

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "worker_count": len(self.actors),
            "workers": self.devices,
            "ray_version": self._ray.__version__,
            "ray_address": self.address,
        }

    def run(self, units: list[Unit]) -> Iterator[tuple[Unit, dict, dict, str]]:
        """Yield ``(unit, data, timing, worker name)`` in the order of ``units``."""
        ray = self._ray
        pending = deque(range(len(units)))  # indexes to hand out, lowest first
        idle = deque(range(len(self.actors)))
        # object ref -> (actor, unit index, or None for a check that a dead actor is back)
        in_flight: dict[Any, tuple[int, int | None]] = {}
        finished: dict[int, tuple[dict, dict, str]] = {}
        attempts = [0] * len(units)
        next_out = 0
        while next_out < len(units):
            while pending and idle:
                actor, index = idle.popleft(), pending.popleft()
                in_flight[self.actors[actor].run.remote(units[index])] = (actor, index)
            if not in_flight:
                raise KvreplayError("Every Ray worker died; see the Ray logs for the cause.")
            [ref], _ = ray.wait(list(in_flight), num_returns=1)
            actor, index = in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                if index is None:
                    _notice(f"Ray worker {self.names[actor]} is gone for good")
                    continue
                attempts[index] += 1
                self._lost(units[index], self.names[actor], attempts[index], exc)
                pending.appendleft(index)
                # Ray restarts the actor; work sent while it restarts would fail, so it
                # takes work again once a call that waits out the restart has answered.
                check = self.actors[actor].device_info.options(max_task_retries=MAX_RESTARTS)
                in_flight[check.remote()] = (actor, None)
                continue
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, KvreplayError):
                    raise exc.cause from None
                raise
            idle.append(actor)
            if index is not None:
                finished[index] = (*result, self.names[actor])
            while next_out in finished:
                data, timing, name = finished.pop(next_out)
                yield units[next_out], data, timing, name
                next_out += 1

    def _lost(self, unit: Unit, worker: str, attempt: int, exc: Exception) -> None:
        """Note a unit lost with its worker; refuse to lose the same unit forever."""
        self.retries += 1
        if attempt >= MAX_ATTEMPTS:
            raise KvreplayError(
                f"Unit {unit.key} was lost with its Ray worker {attempt} times; "
                "it probably kills the worker (see the Ray logs)."
            ) from exc
        _notice(f"Ray worker {worker} died running {unit.key}; handing that unit out again")

    def close(self) -> None:
        """Kill the actors; shut Ray down only if kvreplay started it and no engine is left."""
        global _owned_ray, _live_engines
        if self._closed:
            return
        self._closed = True
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor, no_restart=True)
        _live_engines -= 1
        if _owned_ray and _live_engines == 0:
            self._ray.shutdown()
            _owned_ray = False


def _notice(message: str) -> None:
    """A line on stderr, like the ledger's notices: the run goes on."""
    print(f"kvreplay: {message}", file=sys.stderr)
