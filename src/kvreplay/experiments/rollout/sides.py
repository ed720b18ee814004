"""The rollout CSV read back as sequences (one per item, seed and turn) and their sides,
and the pairs and chains the mismatch is measured on (:mod:`kvreplay.experiments.rollout.metrics`).
The section and the gate read the same sides, so a claim and a verdict cannot disagree.
Plain data and numpy, no torch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvreplay.experiments.rollout.metrics import Decomposition, Pairs, decompose
from kvreplay.experiments.rollout.table import CONTROL, PREFILL, ROLLOUT_SIDE
from kvreplay.harness.table import Ledger


@dataclass(frozen=True)
class Side:
    """One side of a sampled turn: its kind (decode, prefill, control), its
    log-probabilities, how many leading tokens are the rollout's (a control's may be
    fewer than its own), and where reported, a scorer's top-1/top-2 gaps and argmax
    differences and a decode's cached prompt tokens."""

    kind: str
    logprobs: list[float]
    agree: int
    margins: list[float] | None = None
    argmax_differs: list[list[int]] | None = None
    cached_tokens: int | None = None


@dataclass
class Sequences:
    """One precision's sampled turns in ledger order: each turn's key, index and sides."""

    keys: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    sides: list[dict[str, Side]] = field(default_factory=list)

    def scorers(self) -> list[str]:
        """The scorers' labels, the engine's own prefill first where it was scored."""
        found = dict.fromkeys(
            name for sides in self.sides for name, side in sides.items() if side.kind == PREFILL
        )
        return sorted(found, key=lambda name: (name != "engine", list(found).index(name)))

    def with_side(self, name: str) -> Iterator[dict[str, Side]]:
        return (sides for sides in self.sides if name in sides)

    def pairs(self, scorer: str, against: str = ROLLOUT_SIDE) -> Pairs:
        """The scorer's log-probabilities against another side's (the rollout's), over
        every turn that has both, up to where the two sides' tokens agree."""
        both = [s for s in self.sides if scorer in s and against in s]
        ends = [min(s[scorer].agree, s[against].agree) for s in both]
        return Pairs.of(
            [s[against].logprobs[:n] for s, n in zip(both, ends, strict=True)],
            [s[scorer].logprobs[:n] for s, n in zip(both, ends, strict=True)],
            [_cut(s[scorer].margins, n) for s, n in zip(both, ends, strict=True)],
        )

    def chain(self, names: Sequence[str]) -> Decomposition | None:
        """The decomposition along ``names`` (from the rollout's decode to a trainer)
        over every turn that has each side, up to where all their tokens agree; None
        when no turn has them all."""
        both = [s for s in self.sides if all(n in s for n in names)]
        if not both:
            return None
        ends = [min(s[n].agree for n in names) for s in both]
        return decompose(
            [(n, [s[n].logprobs[:end] for s, end in zip(both, ends, strict=True)]) for n in names]
        )


def _cut(values: list[float] | None, end: int) -> list[float] | None:
    return None if values is None else values[:end]


def read_sides(ledger: Ledger) -> dict[str, Sequences]:
    """Each precision's sequences, in ledger order."""
    found: dict[str, Sequences] = {}
    index: dict[tuple[str, str], int] = {}
    for i in range(len(ledger)):
        precision, key = str(ledger["precision"][i]), str(ledger["sequence"][i])
        sequences = found.setdefault(precision, Sequences())
        if (precision, key) not in index:
            index[precision, key] = len(sequences.keys)
            sequences.keys.append(key)
            sequences.turns.append(int(ledger["turn"][i]))
            sequences.sides.append({})
        cached, margins = ledger["cached_tokens"][i], ledger["margins"][i]
        sequences.sides[index[precision, key]][str(ledger["side"][i])] = Side(
            str(ledger["kind"][i]),
            list(ledger["logprobs"][i]),
            int(ledger["agree_tokens"][i]),
            None if margins is None else list(margins),
            ledger["argmax_differs"][i],
            None if np.isnan(cached) else int(cached),
        )
    return found


def controls(sequences: Sequences) -> list[str]:
    """The controls these sequences hold, in the order first seen."""
    return list(
        dict.fromkeys(
            name
            for sides in sequences.sides
            for name, side in sides.items()
            if side.kind == CONTROL
        )
    )
