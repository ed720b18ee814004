"""How many torch intra-op threads each worker process uses: kvreplay chooses, the run's
contract records it (``environment.threads``), ``--threads`` overrides it.

The default is one thread per worker process, whatever ``OMP_NUM_THREADS`` says: on a
shared 2-core machine two threads per process ran about 10x slower than one (OpenMP
spin-waits; see BENCHMARKS.md), and a machine's cores are better used by worker
processes (``--workers``). The count is part of the contract because a CPU matmul's
rounding can depend on how many threads split it, so a resume or an audit on another
count is refused with the flag that restores the recorded one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import missing

DEFAULT_THREADS = 1
# torch refuses counts past a C int; far fewer would already swamp any machine.
MAX_THREADS = 1024


def parse_threads(value: Any) -> int:
    """A thread count: an integer from 1 to MAX_THREADS."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise KvreplayError(
            f"--threads is {value!r}; it must be an integer from 1 to {MAX_THREADS}."
        )
    return value


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the body (contract, in-process worker) on ``threads`` torch threads, then restore
    the caller's count (the core install has no torch: its backends compute on servers)."""
    if missing("torch"):
        parse_threads(threads)
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(parse_threads(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def recorded_threads(contract: dict[str, Any]) -> int | None:
    """The thread count a run's contract records (None if it records none)."""
    environment = contract.get("environment")
    threads = environment.get("threads") if isinstance(environment, dict) else None
    return threads if isinstance(threads, int) and not isinstance(threads, bool) else None


def check_recorded(contract: dict[str, Any], threads: int, run_dir: Any, action: str) -> None:
    """Refuse to ``action`` (resume, audit) a run on a thread count it did not record."""
    recorded = recorded_threads(contract)
    if recorded is not None and recorded != threads:
        plural = "" if recorded == 1 else "s"
        raise KvreplayError(
            f"{run_dir} recorded {recorded} thread{plural} per worker process and this "
            f"{action} would use {threads}; pass --threads {recorded} to {action} it."
        )
