"""The mismatch of a stream of rollouts, measured in one pass with bounded state (design:
mismatch, any size): per group (the stack's precision, or ``logged``) every scorer's
pair (:class:`~kvreplay.experiments.rollout.metrics.PairTally`), each trainer's
decomposition into the engine's and the cross-stack term, the controls, and where
rollouts carry them, the mismatch by step (with its trend) and by environment; and for
a verdict, the trainer's pair pooled over the groups, each sequence judged. The
section's claims and the gate's verdict are both read from it, so a claim and a verdict
cannot disagree. No torch."""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvreplay.backends.rollout import OWN_PREFILL
from kvreplay.experiments.rollout.claims import GroupClaims, typed
from kvreplay.experiments.rollout.metrics import (
    EXP_LIMIT,
    SAFETY_BOUND,
    TRL_SEQUENCE_CAP,
    VERL_SEQUENCE_THRESHOLD,
    ChainTally,
    OutcomeTally,
    PairTally,
    first_argmax_divergence,
    metrics,
    trend,
)
from kvreplay.experiments.rollout.roll import MISS
from kvreplay.experiments.rollout.sides import Rollout, scorers_of
from kvreplay.experiments.rollout.table import CONTROL, ROLLOUT_SIDE
from kvreplay.measure.rates import Json

K = TypeVar("K")
V = TypeVar("V")
TERM = {MISS: "cache"}  # a control's term (any other control: batch)


def stream_of(*names: str) -> int:
    """A bootstrap stream fixed by what is resampled (the terms of one decomposition
    share it: their intervals are paired)."""
    return zlib.crc32("/".join(names).encode()) % 1_000_000


def _json(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def decomposition_claims(chain: ChainTally, names: list[str], stream: int) -> Json:
    """A decomposition's terms (named ``names``) and total, each summarised on the same
    resamples, the term that moves log-probabilities most and the paired interval of how
    much more it moves them than the next one, and whether the terms add up bit for bit
    (``exact``; else within the stated tolerance: inputs that are not float32)."""
    terms = {name: chain.summary(i, stream) for i, name in enumerate(names)}
    ranked = sorted(range(len(names)), key=lambda i: -terms[names[i]]["abs_mean"])
    lead: Json = {"term": names[ranked[0]]}
    if len(ranked) > 1:
        difference, interval = chain.gap(ranked[0], ranked[1], stream)
        lead |= {
            "over": names[ranked[1]],
            "abs_mean_difference": difference,
            "ci95": None if interval is None else [interval.low, interval.high],
            # the interval of the difference lies above 0: the term does move more
            "decided": interval is not None and interval.low > 0,
        }
    return {
        "tokens": chain.tokens,
        "sequences": chain.sequences,
        "terms": terms,
        "total": chain.summary(-1, stream),
        "dominant": lead,
        "exact": chain.exact,
    }


class StepTally:
    """The mismatch of one step (or environment) of a pair, enough for a trend: its
    sequences and tokens, the k3 KL and mean |delta| (each sequence's sum, added up
    exactly), and the sequences verl's and TRL's default corrections act on."""

    def __init__(self) -> None:
        self.k3 = array("d")  # each sequence's sum
        self.magnitude = array("d")
        self.tokens = 0
        self.truncated = 0
        self.masked = 0

    def add(self, rollout: np.ndarray, scorer: np.ndarray) -> None:
        d = scorer - rollout
        self.k3.append(float(np.sum(np.expm1(np.minimum(d, EXP_LIMIT)) - d)))
        self.magnitude.append(float(np.sum(np.abs(d))))
        self.tokens += d.size
        total = float(np.sum(d))
        self.truncated += total > math.log(VERL_SEQUENCE_THRESHOLD)
        self.masked += math.exp(min(total, SAFETY_BOUND)) > TRL_SEQUENCE_CAP

    def claims(self) -> Json:
        return {
            "sequences": len(self.k3),
            "tokens": self.tokens,
            "kl_k3": math.fsum(self.k3) / self.tokens,
            "abs_logp_mean": math.fsum(self.magnitude) / self.tokens,
            "seq_truncated_verl": self.truncated,
            "seq_masked_trl": self.masked,
        }


@dataclass
class ControlTally:
    """A control against the rollout: its term alone, the cached tokens each side
    reported, and (a miss, where the engine scored) the chain rollout decode -> decode
    after a miss -> engine -> trainer."""

    name: str
    sequences: int = 0
    alone: ChainTally = field(default_factory=lambda: ChainTally(1))
    cached: dict[str, list[int | None]] = field(default_factory=dict)
    chains: dict[str, ChainTally] = field(default_factory=dict)


class GroupTally:
    """Everything the section says of one group's rollouts, fed one at a time."""

    def __init__(self, group: str):
        self.group = group
        self.temperatures: set[float | None] = set()
        self.sequences = 0
        self.tokens = 0
        self.kept = 0
        self.masked = False
        self.pairs: dict[str, PairTally] = {}
        self.argmax: dict[str, list[int | None]] = {}
        self.chains: dict[str, ChainTally] = {}
        self.controls: dict[str, ControlTally] = {}
        self.steps: dict[str, dict[int, StepTally]] = {}
        self.environments: dict[str, dict[str, StepTally]] = {}
        self.modes: dict[str, set[tuple[str | None, float | None]]] = {}

    def add(self, rollout: Rollout) -> None:
        sides = rollout.sides
        own = sides[ROLLOUT_SIDE]
        self.temperatures.add(rollout.temperature)
        self.sequences += 1
        self.tokens += own.logprobs.size
        self.masked |= rollout.mask is not None
        for name, side in sides.items():
            if side.mode is not None or side.temperature is not None:
                self.modes.setdefault(name, set()).add((side.mode, side.temperature))
        scorers = scorers_of(sides)
        kept = rollout.kept([ROLLOUT_SIDE])
        self.kept += kept.size
        for name in scorers:
            self._pair(rollout, name, kept)
        if OWN_PREFILL in sides:
            for trainer in (s for s in scorers if s != OWN_PREFILL):
                names = [ROLLOUT_SIDE, OWN_PREFILL, trainer]
                _made(self.chains, trainer, lambda: ChainTally(2)).add(
                    _sides(rollout, names), rollout.key
                )
        for name in (n for n, s in sides.items() if s.kind == CONTROL):
            self._control(rollout, name, [s for s in scorers if s != OWN_PREFILL])

    def _pair(self, rollout: Rollout, name: str, kept: np.ndarray) -> None:
        side = rollout.sides[name]
        own = rollout.sides[ROLLOUT_SIDE]
        pair = _made(self.pairs, name, lambda: PairTally(self.group))
        margins = None if side.margins is None else side.margins[kept]
        r, s = own.logprobs[kept], side.logprobs[kept]
        pair.add(r, s, kept, own.logprobs.size, margins)
        if side.argmax_differs is not None:
            reported = side.argmax_differs
            if rollout.mask is not None:
                reported = [p for p in reported if rollout.mask[int(p[0])]]
            self.argmax.setdefault(name, []).append(first_argmax_divergence(reported))
        if rollout.step is not None and r.size:
            _made(self.steps.setdefault(name, {}), rollout.step, StepTally).add(r, s)
        if rollout.environment is not None and r.size:
            by = self.environments.setdefault(name, {})
            _made(by, rollout.environment, StepTally).add(r, s)

    def _control(self, rollout: Rollout, name: str, trainers: list[str]) -> None:
        control = _made(self.controls, name, lambda: ControlTally(name))
        control.sequences += 1
        control.alone.add(_sides(rollout, [ROLLOUT_SIDE, name]), rollout.key)
        for side in (ROLLOUT_SIDE, name):
            control.cached.setdefault(side, []).append(rollout.sides[side].cached_tokens)
        if name != MISS or OWN_PREFILL not in rollout.sides:
            return
        for trainer in [*trainers, OWN_PREFILL]:
            names = [ROLLOUT_SIDE, MISS, OWN_PREFILL] + (
                [trainer] if trainer != OWN_PREFILL else []
            )
            if trainer not in control.chains:
                control.chains[trainer] = ChainTally(len(names) - 1)
            control.chains[trainer].add(_sides(rollout, names), rollout.key)

    def scorers(self) -> list[str]:
        """The scorers' labels, the engine's own prefill first where it was scored."""
        names = list(self.pairs)
        return sorted(names, key=lambda name: (name != OWN_PREFILL, names.index(name)))

    def claims(self) -> Json:
        """What the section says of this group."""
        greedy = self.temperatures == {0.0}
        known = {t for t in self.temperatures if t is not None}
        claims: Json = {
            "temperature": known.pop()
            if len(known) == 1 and None not in self.temperatures
            else None,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "scorers": {name: self._scorer_claims(name, greedy) for name in self.scorers()},
            "decomposition": {
                trainer: decomposition_claims(
                    chain.finish(), ["engine", "cross"], stream_of(self.group, trainer)
                )
                for trainer, chain in self.chains.items()
                if chain.finish().tokens
            },
            "controls": {name: self._control_claims(c) for name, c in self.controls.items()},
        }
        if self.masked:
            claims["kept_tokens"] = self.kept
        if self.modes:
            claims["logprobs"] = {
                side: [{"mode": m, "temperature": t} for m, t in sorted(found, key=str)]
                for side, found in sorted(self.modes.items())
            }
        if self.steps:
            claims["steps"] = {name: _steps_claims(by) for name, by in sorted(self.steps.items())}
        if self.environments:
            claims["environments"] = {
                name: {env: t.claims() for env, t in sorted(by.items())}
                for name, by in sorted(self.environments.items())
            }
        return claims

    def _scorer_claims(self, name: str, greedy: bool) -> Json:
        pair = self.pairs[name]
        totals = pair.totals()
        firsts = self.argmax.get(name, [])
        parted = [f for f in firsts if f is not None]
        return {
            "metrics": {k: _json(v) for k, v in metrics(totals).items()},
            "by_position": [{k: _json(v) for k, v in b.items()} for b in pair.by_position()],
            "by_margin": [{k: _json(v) for k, v in b.items()} for b in pair.by_margin()],
            "argmax": {
                "greedy": greedy,
                "sequences": len(firsts),  # those whose scorer reported its argmax
                "sequences_parted": len(parted),
                "first_index_median": float(np.median(parted)) if parted else None,
            },
        }

    def _control_claims(self, control: ControlTally) -> Json:
        term = TERM.get(control.name, "batch")
        found: Json = {"term": term, "sequences": control.sequences}
        alone = control.alone.finish()
        if not alone.tokens:
            return found | {"tokens": 0}
        found |= decomposition_claims(alone, [term], stream_of(self.group, control.name))
        found["cached_tokens"] = {
            ROLLOUT_SIDE: [h for h in control.cached[ROLLOUT_SIDE] if h is not None],
            control.name: control.cached[control.name],
        }
        if control.chains:
            trainers = [t for t in control.chains if t != OWN_PREFILL] or [OWN_PREFILL]
            found["chains"] = {}
            for trainer in trainers:
                chain = control.chains[trainer].finish()
                if chain.tokens:
                    names = ["cache", "engine", "cross"][: chain.width - 1]
                    found["chains"][trainer] = decomposition_claims(
                        chain, names, stream_of(self.group, control.name, trainer)
                    )
        return found


def _made(found: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """The entry of ``key``, made on first use (a tally holds a spill file: made once)."""
    if key not in found:
        found[key] = make()
    return found[key]


def _sides(rollout: Rollout, names: list[str]) -> list[np.ndarray]:
    kept = rollout.kept(names)
    return [rollout.sides[name].logprobs[kept] for name in names]


def _steps_claims(by: dict[int, StepTally]) -> Json:
    steps = sorted(by)
    rows = [{"step": step, **by[step].claims()} for step in steps]
    return {"by_step": rows, "trend": trend(steps, [row["kl_k3"] for row in rows])}


@dataclass
class Measured:
    """A stream of rollouts measured: each group's tally, and the trainer's pair pooled
    over the groups with each sequence's outcome (where a trainer is judged)."""

    groups: dict[str, GroupTally]
    pooled: OutcomeTally | None = None

    def claims(self) -> dict[str, GroupClaims]:
        """Each group's claims, as their types."""
        return typed({group: tally.claims() for group, tally in self.groups.items()})


def measure(rollouts: Iterable[Rollout], trainer: str | None = None) -> Measured:
    """One pass over the rollouts (each read once, none kept)."""
    measured = Measured({}, OutcomeTally() if trainer else None)
    for rollout in rollouts:
        group = measured.groups.get(rollout.group)
        if group is None:
            group = measured.groups[rollout.group] = GroupTally(rollout.group)
        group.add(rollout)
        if measured.pooled is not None and trainer in rollout.sides:
            kept = rollout.kept([ROLLOUT_SIDE])
            own = rollout.sides[ROLLOUT_SIDE]
            measured.pooled.add(
                own.logprobs[kept], rollout.sides[trainer].logprobs[kept], kept,
                rollout.key, rollout.group, rollout.where,
            )  # fmt: skip
    return measured
