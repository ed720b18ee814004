"""Panels: what a unit runs, declared once. An experiment declares its arms (which
constructions, which transplants, replicas or not) and an executor runs the declaration
into a typed :class:`~kvreplay.harness.rows.PanelRow`: in process
(:func:`kvreplay.harness.executor.run_panel`, which loads torch) or on a serving
backend (:func:`kvreplay.harness.served.run_served_panel`). Declarations are plain
data, so the core install (no torch) reads every experiment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from kvreplay.harness.rows import is_replica, replica_name

Replica = Literal["replica", "clone", "none"]
"""What an arm gets beside it: a replica (checked and continued), a clone (checked only;
in process) or nothing."""


@dataclass(frozen=True)
class Arm:
    """A declared arm: one construction of the boundary state, continued, and what it
    gets beside it: a ``replica`` (checked and continued too), a ``clone`` (checked
    only) or nothing."""

    name: str
    construction: str
    replica: Replica = "replica"


@dataclass(frozen=True)
class Transplanted:
    """A declared transplant arm: the recipient arm's state carrying every K/V layer of
    the donor arm's state, continued without a replica."""

    name: str
    donor: str
    recipient: str


@dataclass(frozen=True)
class Samples:
    """Seeded continuations of every arm (design: resample): each seed continues its own
    copy of the arm's state with the run's sampler reseeded, so the same seed drives
    every arm. A replica continues only the first ``replica`` seeds: enough to gate the
    stack's determinism without doubling the cost."""

    seeds: tuple[int, ...]
    replica: int

    def of(self, name: str) -> tuple[int, ...]:
        return self.seeds[: self.replica] if is_replica(name) else self.seeds


class Declared(Protocol):
    """What a panel needs of an arm's declaration, in-process (:class:`Arm`) or served
    (:class:`~kvreplay.harness.served.ServedArm`)."""

    @property
    def name(self) -> str: ...
    @property
    def construction(self) -> str: ...
    @property
    def replica(self) -> Replica: ...


A = TypeVar("A", bound=Declared)


@dataclass(frozen=True)
class Panel(Generic[A]):
    """What a unit runs: its arms (the first two are the compared pair) and transplants.
    With ``keep_states`` the arms continue copies and the boundary states stay for the
    experiment's own probes; with ``samples`` each arm is continued once per seed. A
    served experiment's panel declares served arms (:func:`run_panel` builds ``Arm``s,
    :func:`~kvreplay.harness.served.run_served_panel` serves ``ServedArm``s)."""

    arms: tuple[A, ...]  # the first two are the compared pair (left, right)
    transplants: tuple[Transplanted, ...] = ()
    keep_states: bool = False
    samples: Samples | None = None

    @property
    def compared(self) -> tuple[str, str]:
        return self.arms[0].name, self.arms[1].name

    @property
    def under_traffic(self) -> list[str]:
        """The arms that run while loopback clients load the server (served arms only)."""
        return [arm.name for arm in self.arms if getattr(arm, "traffic", False)]

    @property
    def arm_names(self) -> list[str]:
        """Every continued arm, in the order they run: each arm and its replica, then
        the transplants."""
        names = []
        for arm in self.arms:
            names += [arm.name, replica_name(arm.name)] if arm.replica == "replica" else [arm.name]
        return names + [t.name for t in self.transplants]
