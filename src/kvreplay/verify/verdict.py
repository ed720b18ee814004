"""Verdicts (design: check, verdict, expectation, level, power): a run's rows judged
against what should hold, at two levels, as a value. The *tokens* level asks whether
the compared continuations agree (suffix, answer, label); the *bits* level asks whether
their numerics do (boundary logits, every step's logits or top-k logprobs, K/V where the
backend has K/V access). A verdict names the level it holds at and states its power: the
95% upper bound on the divergence rate its items rule out. Everything here judges;
:mod:`kvreplay.verify.render` says it (a sentence, JSON, JUnit, a screen).

Where a panel has an arm that runs under traffic (``history`` under ``--traffic N``),
that arm is compared too: the hit under traffic against the hit alone, at both levels,
so a continuation that depends on what else the server was doing fails the check like
one that depends on the cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.core.power import rate_upper_bound
from kvreplay.experiments.battery.experiment import MEASURED
from kvreplay.harness.experiment import Experiment
from kvreplay.ledger import Record
from kvreplay.measure.certificate import FAITHFUL, CertificateClaims
from kvreplay.verify.expectation import Expectation
from kvreplay.verify.outcome import ItemOutcome, outcomes

HOLDS, FAILS = 0, 1  # exit codes; a refusal is 2
# What a verdict reports of the server's load under traffic (backends.traffic.Load).
LOAD_FIGURES = (
    "in_flight_max", "server_running_max", "server_waiting_max", "kv_cache_usage_max",
    "preemptions",
)  # fmt: skip


def judged(items: Iterable[ItemOutcome]) -> list[ItemOutcome]:
    """The items that test the stack: they reached the boundary and, served, their hit
    read the cache (a hit over no cached token is a second miss). Every count, level
    and bound of a verdict, and every stop, is over these."""
    return [o for o in items if o.reached and o.cache_hit_tokens != 0]


@dataclass(frozen=True)
class Verdict:
    """A check's outcome against its expectation: each item, the certificate when
    sampled, the environment it ran in, how many item rows it meant to run
    (``planned``: it stops once the verdict is decided), and the fault planted in the
    engine while it ran (a measurement of the fault suite, never a real engine's)."""

    expectation: Expectation
    compared: tuple[str, str]
    items: list[ItemOutcome]
    certificate: CertificateClaims | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    planned: int | None = None
    planted_fault: str | None = None  # the fault planted in the engine while it ran

    @property
    def reached(self) -> list[ItemOutcome]:
        return [o for o in self.items if o.reached]

    @property
    def judged(self) -> list[ItemOutcome]:
        return judged(self.items)

    @property
    def divergent(self) -> list[ItemOutcome]:
        return [o for o in self.judged if o.diverges]

    @property
    def broken(self) -> list[ItemOutcome]:
        """Items whose replicas disagreed: the stack is not deterministic there."""
        return [o for o in self.reached if not o.replicas_ok]

    @property
    def uncached(self) -> list[ItemOutcome]:
        """Served items whose hit read no cached token of P (P shorter than one cache
        block): there the hit was a second miss, and the item tests no caching."""
        return [o for o in self.reached if o.cache_hit_tokens == 0]

    @property
    def bits_differ(self) -> list[ItemOutcome]:
        return [o for o in self.judged if o.bits == "differ"]

    @property
    def bits_unknown(self) -> list[ItemOutcome]:
        return [o for o in self.judged if o.bits == "unknown"]

    @property
    def tokens_hold(self) -> bool:
        return len(self.divergent) <= self.expectation.allowed

    @property
    def bits_hold(self) -> bool:
        return not self.bits_differ and not self.bits_unknown

    @property
    def holds(self) -> bool:
        if self.broken or not self.judged:
            return False
        if self.expectation.kind == "faithful":
            return self.certificate is not None and self.certificate.verdict == FAITHFUL
        return self.bits_hold if self.expectation.kind == "bitwise" else self.tokens_hold

    @property
    def exit_code(self) -> int:
        return HOLDS if self.holds else FAILS

    def rate_bound(self, level: str) -> float | None:
        """The 95% upper bound on the rate of judged items that part at ``level``
        (tokens or bits); None for the certificate."""
        if level == "tokens":
            return rate_upper_bound(len(self.divergent), len(self.judged))
        if level == "bits":
            parted = len(self.bits_differ) + len(self.bits_unknown)
            return rate_upper_bound(parted, len(self.judged))
        return None

    @property
    def stopped_early(self) -> bool:
        return self.planned is not None and len(self.items) < self.planned

    def passes(self, outcome: ItemOutcome) -> bool:
        """Whether one item meets the expectation at its level."""
        if not (outcome.reached and outcome.replicas_ok):
            return False
        if self.expectation.kind == "bitwise":
            return outcome.bits == "equal" or outcome.cache_hit_tokens == 0
        return not outcome.diverges

    @property
    def traffic(self) -> dict[str, Any] | None:
        """The arm under traffic against the compared pair, over the items where it ran,
        with the most the server reported in flight (None: no arm ran under traffic)."""
        ran = [o for o in self.judged if o.traffic_differs is not None]
        if not ran:
            return None
        left, right = self.compared
        return {
            "items": len(ran),
            "suffix_differs_from": {
                left: sum(bool(o.traffic_differs) for o in ran),
                right: sum(bool(o.traffic_differs_from_right) for o in ran),
            },
            "numerics_differ_from": {left: sum(bool(o.traffic_numerics_differ) for o in ran)},
            "load": _most_load([o.traffic_load for o in ran if o.traffic_load]),
        }

    @property
    def shapes(self) -> dict[str, Any] | None:
        """A battery's shapes over its items (None: not a battery): those that ran, by
        the level each was compared at, those never exercised and why, where the level
        was measured, and beside them the paper's question (``live``: on how many items
        the hit at a random cut continued as the live decode it cut, bit for bit)."""
        rows = [o for o in self.reached if o.shapes is not None]
        if not rows:
            return None
        seen = [s for o in rows for s in o.shapes or []]
        ran = [s for s in seen if s["exercised"] is not False]
        names = list(dict.fromkeys(s["shape"] for s in ran))
        levels: dict[str, list[str]] = {}
        for name in names:
            level = next(s["level"] for s in ran if s["shape"] == name)
            levels.setdefault(level, []).append(name)
        unexercised = {
            s["shape"]: s["note"] or "not exercised" for s in seen if s["shape"] not in names
        }
        precisions = list(dict.fromkeys(o.precision for o in rows))
        backend = self.environment.get("backend") or {}
        engine = str(backend.get("server", backend.get("name", "")))
        measured = [MEASURED[(engine, p)] for p in precisions if (engine, p) in MEASURED]
        live = [s["live_equal"] for s in seen if s.get("live_equal") is not None]
        return {
            "ran": names,
            "live": {"items": len(live), "equal": sum(live)},
            "levels": levels,
            "unexercised": unexercised,
            "precisions": precisions,
            "measured": f" (the level measured: {measured[0]})" if measured else "",
        }

    def counts(self) -> dict[str, int]:
        reached = self.reached
        return {
            "items": len(self.items),
            "reached": len(reached),
            "suffixes_differ": len(self.divergent),
            "answers_differ": sum(o.answer_differs for o in reached),
            "labels_flip": sum(o.label_flips for o in reached),
            "replicas_disagree": len(self.broken),
            "numerics_differ": len(self.bits_differ),
            "numerics_unrecorded": len(self.bits_unknown),
            "boundary_logits_differ": sum(o.logits_equal is False for o in reached),
        }

    def levels(self) -> dict[str, Any]:
        """Both levels, each with what parts, what was judged and its power."""
        count = len(self.judged)
        first = self.bits_differ[0] if self.bits_differ else None
        return {
            "tokens": {
                "holds": not self.divergent,
                "items": count,
                "differ": len(self.divergent),
                "rate_upper_95": self.rate_bound("tokens"),
            },
            "bits": {
                "holds": self.bits_hold if count else None,
                "items": count,
                "differ": len(self.bits_differ),
                "unrecorded": len(self.bits_unknown),
                "first": None
                if first is None
                else {
                    "item_id": first.item_id,
                    "precision": first.precision,
                    "step": first.numeric_step,
                },
                "rate_upper_95": self.rate_bound("bits"),
            },
        }


def _most_load(loads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The most the server reported in flight over the items' traffic arms: each of
    :data:`LOAD_FIGURES`' maximum (None: no row recorded a load)."""
    if not loads:
        return None
    return {
        k: max((v for load in loads if (v := load.get(k)) is not None), default=None)
        for k in LOAD_FIGURES
    }


def judge(
    experiment: Experiment,
    rows: Iterable[Record],
    expectation: Expectation,
    environment: dict[str, Any] | None = None,
    planned: int | None = None,
    planted_fault: str | None = None,
) -> Verdict:
    """The verdict of a run's rows (read once, twice for a sampled run, which is judged
    by its certificate); ``planted_fault``: the fault its manifest records."""
    items = outcomes(experiment, rows)
    certificate = None
    if any(o.seeds for o in items):
        certificate = _certificate(experiment, rows, expectation.margin)
    arms = experiment.panel.arms
    compared = (arms[0].construction, arms[1].construction)
    return Verdict(
        expectation, compared, items, certificate, environment or {}, planned, planted_fault
    )


def decided(experiment: Experiment, expectation: Expectation, rows: list[Record]) -> bool:
    """Whether the rows so far already decide a FAIL, so a check stops running items:
    replicas that disagreed; under ``bitwise``, the first judged item whose numerics part
    (or cannot be compared); under ``--max-rate``, and on a battery's rows (its first
    detection), more parted items than it allows."""
    items = outcomes(experiment, rows)
    if any(o.reached and not o.replicas_ok for o in items):
        return True
    if expectation.kind == "bitwise":
        return any(o.bits != "equal" for o in judged(items))
    battery = any(o.detected is not None for o in items)  # stops at the first detection
    if (expectation.max_rate is not None or battery) and expectation.kind != "faithful":
        return sum(o.diverges for o in judged(items)) > expectation.allowed
    return False


@dataclass(frozen=True)
class StopRule:
    """:func:`decided` as a run's stop rule (:class:`~kvreplay.run.runner.Stop`): the
    manifest records its expectation, from which an audit re-derives the stop."""

    experiment: Experiment
    expectation: Expectation

    def __call__(self, rows: list[Record]) -> bool:
        return decided(self.experiment, self.expectation, rows)

    def to_json(self) -> dict[str, Any]:
        return {"expectation": asdict(self.expectation)}

    @classmethod
    def from_json(cls, experiment: Experiment, data: dict[str, Any]) -> StopRule:
        return cls(experiment, Expectation(**data["expectation"]))


def _certificate(
    experiment: Experiment, rows: Iterable[Record], margin: float
) -> CertificateClaims:
    from kvreplay.measure.certificate import PairedSamples, certify

    samples = []
    for record in rows:
        if record.data.get("kind") == "prefix" or record.data["status"] != "ok":
            continue
        pairs = experiment.read_row(record.data).pairs
        samples.append(
            PairedSamples(
                item=record.data["item_id"],
                live=tuple(a.answer for a, _ in pairs),
                prefill=tuple(b.answer for _, b in pairs),
                live_correct=tuple(a.correct for a, _ in pairs),
                prefill_correct=tuple(b.correct for _, b in pairs),
                changed=tuple(a.suffix_sha256 != b.suffix_sha256 for a, b in pairs),
            )
        )
    return certify(samples, margin).claims()


def run_verdicts(
    experiment: Experiment, rows: list[Record], margin: float
) -> dict[str | None, Verdict]:
    """The verdicts a ``kvreplay run`` ends with: its rows against the default expectation
    (every suffix equal; key None), or, sampled, each precision's against the certificate
    (keyed by precision)."""
    if not any(r.data.get("samples") for r in rows):
        return {None: judge(experiment, rows, Expectation("exact", 0, margin))}
    expectation = Expectation("faithful", 0, margin)
    precisions = dict.fromkeys(r.data["precision"] for r in rows)
    return {
        p: judge(experiment, [r for r in rows if r.data["precision"] == p], expectation)
        for p in precisions
    }
