"""What ``kvreplay check`` gives back, whichever kind of verdict it judged (design: check,
verdict): the live vs prefill verdict (:mod:`kvreplay.verify.verdict`) or an experiment's
own, reached through its declaration (``Declaration.gate``: the rollout experiment's
mismatch verdict for ``check --trainer``, the weight-update experiment's stale-cache
verdict for ``check --update``). Every kind answers the same two questions (does it
hold, which exit code) and comes with its renderings, so the command, the pytest helper
and the outputs name no kind.

A check asks an experiment's gate with a typed request (:class:`GateRequest`: the role,
what the role's option named, the expectation given and the gate's own options), never
with the whole command line; kvreplay check runs the experiment, and the gate judges its
rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvreplay.ledger import Record
from kvreplay.measure.rates import Json


class GateVerdict(Protocol):
    """A verdict a check gives: whether the expectation holds, and the exit code."""

    @property
    def holds(self) -> bool: ...

    @property
    def exit_code(self) -> int: ...


@dataclass(frozen=True)
class Judged:
    """A check's verdict with what it says: its sentence, the screen, the JSON of
    ``--json`` and the JUnit XML of ``--junit``."""

    verdict: GateVerdict
    sentence: str
    screen: str
    json: Json
    junit: str

    @property
    def holds(self) -> bool:
        return self.verdict.holds

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code


@dataclass(frozen=True)
class GateRequest:
    """What ``kvreplay check --ROLE SPEC`` asks the gate of the experiment that serves the
    role (``trainer``: the trainer's scorer spec; ``update``: the weights to update to):
    the spec, ``--expect`` and the gate's own options as given (its bounds, and the
    experiment options a check takes)."""

    role: str
    spec: str
    expect: str | None = None
    own: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class GateRun:
    """What the gate asks kvreplay check to run: the experiment's options (beside the
    shared run options), the folder name's suffix, and the paths the run reads besides
    the check's items, model and plan (a trainer's own model, the weights of an update),
    which no output may overwrite."""

    options: dict[str, object]
    suffix: str
    reads: tuple[str, ...] = ()


class Gate(Protocol):
    """An experiment's gate in a check role: it refuses what it cannot judge before
    anything runs, says what to run, and judges the rows of the run."""

    options: str | None  # module:Class of its own options (None: it has none)
    takes: tuple[str, ...]  # the experiment's own options a check takes

    def plan(self, request: GateRequest) -> GateRun: ...

    def judge(
        self,
        request: GateRequest,
        rows: list[Record],
        config: Json,
        stack: str,
        environment: Json,
    ) -> Judged: ...
