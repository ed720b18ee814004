"""Rollouts as the mismatch reads them, one at a time (design: mismatch, any size): a
sampled turn's sides (the rollout's decode, each scorer's pass, each control), the
tokens that count (its mask: the response's own tokens, not padding or tool output),
and where it came from (a logged rollout's step, rank and environment). The rollout
CSV's lines are read into them here (a turn's sides are consecutive lines), as are a
framework's logged rollouts (:mod:`kvreplay.experiments.rollout.logged`). Plain data
and numpy, no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvreplay.experiments.rollout.table import PREFILL, ROLLOUT_TABLE
from kvreplay.harness.table import LedgerError
from kvreplay.ledger import Record


@dataclass(frozen=True)
class Side:
    """One side of a sampled turn: its kind (decode, prefill, control), its
    log-probabilities, how many leading tokens are the rollout's (a control's may be
    fewer than its own), and where reported, a scorer's top-1/top-2 gaps and argmax
    differences and a decode's cached prompt tokens; a logged side may say which
    log-probability it holds (raw, processed) and at what temperature."""

    kind: str
    logprobs: np.ndarray
    agree: int
    margins: np.ndarray | None = None
    argmax_differs: list[list[int]] | None = None
    cached_tokens: int | None = None
    mode: str | None = None
    temperature: float | None = None


@dataclass(frozen=True)
class Rollout:
    """One sampled turn: its key, its group (the stack's precision, or ``logged``), the
    temperature it was sampled at (None: not known), its sides by name, the tokens that
    count (None: every one), where it came from (``step``, ``rank``, ``environment``,
    where logged) and, logged, its prompt and response ids (for a rescorer)."""

    key: str
    group: str
    temperature: float | None
    sides: dict[str, Side]
    mask: np.ndarray | None = None
    where: dict[str, Any] = field(default_factory=dict)
    ids: tuple[np.ndarray, np.ndarray] | None = None

    def kept(self, names: Sequence[str]) -> np.ndarray:
        """The indices of the tokens compared across these sides: those every side
        shares with the rollout (a control's agree), that the mask keeps."""
        end = min(self.sides[n].agree for n in names)
        if self.mask is None:
            return np.arange(end)
        return np.flatnonzero(self.mask[:end])

    @property
    def step(self) -> int | None:
        step = self.where.get("step")
        return None if step is None else int(step)

    @property
    def environment(self) -> str | None:
        environment = self.where.get("environment")
        return None if environment is None else str(environment)


def scorers_of(sides: Mapping[str, Side]) -> list[str]:
    """The scorers among a turn's sides, in order."""
    return [name for name, side in sides.items() if side.kind == PREFILL]


def rollouts(file: str, lines: Iterable[Mapping[str, Any]]) -> Iterator[Rollout]:
    """The typed lines of ``rollout_logprobs.csv`` (:meth:`~kvreplay.harness.table.Ledger.lines`)
    as rollouts, one at a time; a turn's sides must be consecutive lines."""
    done: set[tuple[str, str]] = set()
    current: tuple[str, str] | None = None
    sides: dict[str, Side] = {}
    temperature = None
    for line in lines:
        key = (str(line["precision"]), str(line["sequence"]))
        if key != current:
            if current is not None:
                yield Rollout(current[1], current[0], temperature, sides)
            if key in done:
                raise LedgerError(
                    file, "a turn's lines are not together", str(line["row_id"]), "sequence"
                )
            done.add(key)
            current, sides, temperature = key, {}, float(line["temperature"])
        cached, margins = line["cached_tokens"], line["margins"]
        sides[str(line["side"])] = Side(
            str(line["kind"]),
            np.asarray(line["logprobs"], dtype=np.float64),
            int(line["agree_tokens"]),
            None if margins is None else np.asarray(margins, dtype=np.float64),
            line["argmax_differs"],
            None if np.isnan(cached) else int(cached),
        )
    if current is not None:
        yield Rollout(current[1], current[0], temperature, sides)


def recorded(records: list[Record], config: Mapping[str, Any]) -> Iterator[Rollout]:
    """A run's completed rollout rows as rollouts, through the lines of their CSV (the
    rows read a line at a time, as ``analyze`` reads the CSV)."""
    ledger = ROLLOUT_TABLE.ledger(records, config)
    return rollouts(ledger.file, ledger.lines())
