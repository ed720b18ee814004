"""The local engine with ``--workers N``: the same units on N spawned worker processes of
this machine, rows in the same order.

Each process holds one :class:`~kvreplay.engines.worker.Worker` (each precision's model
loaded once) on the driver's torch thread count, which the run's contract records. Units
go to whichever process is idle; the driver alone writes rows, so a result that arrives
early waits until every unit before it has been yielded, and the ledger and its CSVs are
byte-identical to a serial run's. Processes are spawned, never forked: a forked copy of a
driver that already ran torch can deadlock in OpenMP.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import traceback
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError
from kvreplay.engines.worker import Worker
from kvreplay.harness.units import Unit

# How long close() waits for a worker to exit before it terminates it.
STOP_TIMEOUT_S = 10.0


def _die_with(driver: int) -> None:
    """A driver killed outright (SIGKILL) cannot stop its workers, and a busy one would
    run on for a whole unit: on Linux the kernel kills a worker when its driver dies."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != driver:  # the driver died before the request took hold
        os._exit(0)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextmanager
def _started_with(environment: dict[str, str]) -> Iterator[None]:
    """A spawned process starts with this process's environment: set ``environment``
    for the start alone."""
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _serve(conn: Connection, config: RunConfig, name: str, threads: int, driver: int) -> None:
    """A worker process: answer ``device_info`` once, then run units until told to stop.

    Every reply is ``("ok", value)`` or ``("error", exception or traceback text)``.
    Ctrl-C reaches the driver, which stops the workers; they ignore it themselves.
    """
    _die_with(driver)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    worker = Worker(config, name)
    conn.send(
        (
            "ok",
            {
                **worker.device_info(),
                "threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            },
        )
    )
    while True:
        try:
            unit = conn.recv()
        except EOFError:  # the driver is gone
            return
        if unit is None:
            return
        try:
            conn.send(("ok", worker.run(unit)))
        except KvreplayError as exc:
            conn.send(("error", exc))
        except Exception:  # noqa: BLE001 - a bug: the driver shows the worker's traceback
            conn.send(("error", traceback.format_exc()))


class ProcessEngine:
    """Runs units on ``workers`` spawned processes of this machine."""

    name = "local"

    def __init__(self, config: RunConfig, workers: int, environment: dict[str, str] | None = None):
        context = multiprocessing.get_context("spawn")
        threads = torch.get_num_threads()
        self.backend = config.backend.name
        self.names = [f"local-{i}" for i in range(workers)]
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        self.busy: dict[int, int] = {}  # worker -> index of the unit it is running
        for name in self.names:
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(theirs, config, name, threads, os.getpid()),
                name=name,
                daemon=True,
            )
            with _started_with(environment or {}):
                process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        try:
            self.devices = [self._reply(i, "starting") for i in range(workers)]
        except BaseException:
            self.close()
            raise

    def _reply(self, index: int, doing: str) -> Any:
        """The next answer of worker ``index``; a dead worker or a failed unit ends the run."""
        try:
            status, value = self.conns[index].recv()
        except (EOFError, OSError) as exc:
            raise KvreplayError(self._death(index, doing)) from exc
        if status == "ok":
            return value
        if isinstance(value, KvreplayError):
            raise value
        raise RuntimeError(f"worker process {self.names[index]} failed:\n{value}")

    def _death(self, index: int, doing: str) -> str:
        """How worker ``index`` died (its signal, once the process has ended)."""
        process = self.processes[index]
        process.join(STOP_TIMEOUT_S)
        code = process.exitcode
        how = f" with {signal.Signals(-code).name} (signal {-code})" if code and code < 0 else ""
        return (
            f"Worker process {self.names[index]} (the {self.backend} engine) died{how} while "
            f"{doing}; the rows before it are kept, and rerunning the same command resumes "
            "after them."
        )

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "worker_count": len(self.names), "workers": self.devices}

    def run(self, units: list[Unit]) -> Iterator[tuple[Unit, dict, dict, str]]:
        """Yield ``(unit, data, timing, worker name)`` in the order of ``units``."""
        if self.busy:
            raise RuntimeError("a ProcessEngine whose last run was abandoned cannot run again")
        pending = deque(range(len(units)))
        idle = deque(range(len(self.conns)))
        busy = self.busy
        finished: dict[int, tuple[dict, dict, str]] = {}
        next_out = 0
        while next_out < len(units):
            while pending and idle:
                worker, index = idle.popleft(), pending.popleft()
                self.conns[worker].send(units[index])
                busy[worker] = index
            for conn in wait([self.conns[w] for w in busy]):
                worker = self.conns.index(conn)  # type: ignore[arg-type]
                index = busy.pop(worker)
                data, timing = self._reply(worker, f"running row {units[index].key}")
                finished[index] = (data, timing, self.names[worker])
                idle.append(worker)
            while next_out in finished:
                data, timing, name = finished.pop(next_out)
                yield units[next_out], data, timing, name
                next_out += 1

    def close(self) -> None:
        """Ask every idle worker to stop; terminate a busy one (the run was interrupted) or
        one that does not stop."""
        for worker, conn in enumerate(self.conns):
            if worker in self.busy:
                self.processes[worker].terminate()
                continue
            try:
                conn.send(None)
            except OSError:  # already gone
                pass
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join()
        for conn in self.conns:
            conn.close()
