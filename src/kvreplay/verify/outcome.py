"""One item at one precision judged at both levels (design: level, numeric divergence
index): do the compared continuations agree, where and how narrowly do they part, and do
their numerics agree bit for bit. :func:`outcomes` reads them from an experiment's rows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvreplay.core.comparison import first_divergence
from kvreplay.core.trajectory import numeric_divergence
from kvreplay.experiments.battery.outcome import calibration, is_battery, shape_outcomes
from kvreplay.harness.experiment import Experiment
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.harness.rows import ArmResult, PanelRow

Bits = Literal["equal", "differ", "unknown"]


@dataclass(frozen=True)
class ItemOutcome:
    """One item at one precision, at both levels: do the compared continuations agree,
    where and how narrowly do they part (the top-1/top-2 margins at the first divergence;
    a flip on a near-tie has a margin near 0), and do their numerics agree bit for bit
    (``numeric_divergence``: the first step where they part, even when tokens never do;
    step 0 is the boundary logits)."""

    item_id: str
    precision: str
    reached: bool
    replicas_ok: bool
    suffix_differs: bool = False
    answer_differs: bool = False
    label_flips: bool = False
    first_divergence: int | None = None
    left_margin: float | None = None
    right_margin: float | None = None
    seeds_changed: int | None = None  # resample: seeds whose sampled tokens changed
    seeds: int | None = None
    cache_hit_tokens: int | None = None  # served: cached tokens of P the hit read
    logits_equal: bool | None = None  # boundary logits (served: first-step logprobs)
    kv_equal: bool | None = None  # boundary K/V, where the backend has K/V access
    numerics_recorded: bool = False  # both continuations hold every step's digest
    numeric_divergence: int | None = None
    # The arm under traffic (None: the panel has none, or it did not run) against the
    # compared pair's left arm (the hit alone) and right arm (the miss).
    traffic_differs: bool | None = None
    traffic_differs_from_right: bool | None = None
    traffic_numerics_differ: bool | None = None
    traffic_load: dict[str, Any] | None = None  # what the server reported meanwhile
    # A battery row (design: request shape): the shapes that parted hit from miss at
    # their level, and each shape as the verdict reports it (None: not a battery row).
    detected: tuple[str, ...] | None = None
    shapes: list[dict[str, Any]] | None = None

    @property
    def pair_diverges(self) -> bool:
        """The compared pair's continuations part (a seed's, for a sampled row; for a
        battery, any shape's hit and miss at the shape's level)."""
        if self.detected is not None:
            return bool(self.detected)
        return self.suffix_differs or bool(self.seeds_changed)

    @property
    def diverges(self) -> bool:
        return self.pair_diverges or bool(self.traffic_differs)

    @property
    def bits(self) -> Bits:
        """The bits level: equal, differ, or unknown (a row without step digests whose
        boundary numerics agree)."""
        if not self.reached:
            return "unknown"
        if self.logits_equal is False or self.kv_equal is False or self.traffic_numerics_differ:
            return "differ"
        if not self.numerics_recorded:
            return "unknown"
        return "equal" if self.numeric_divergence is None else "differ"

    @property
    def numeric_step(self) -> int | None:
        """Where numerics part: the recorded step, else 0 when the boundary differs."""
        if self.numerics_recorded and self.numeric_divergence is not None:
            return self.numeric_divergence
        return 0 if self.bits == "differ" else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bits": self.bits}


def _under_traffic(traffic: ArmResult | None, left: ArmResult, right: ArmResult) -> dict[str, Any]:
    """The arm under traffic against the hit alone (``left``) and the miss (``right``)."""
    if traffic is None:
        return {}
    numerics = numeric_divergence(traffic.suffix, left.suffix)
    return {
        "traffic_differs": traffic.suffix_sha256 != left.suffix_sha256,
        "traffic_differs_from_right": traffic.suffix_sha256 != right.suffix_sha256,
        "traffic_numerics_differ": traffic.logits_fingerprint != left.logits_fingerprint
        or numerics.parts,
        "traffic_load": traffic.served.load if traffic.served is not None else None,
    }


def outcomes(experiment: Experiment, rows: Iterable[Record]) -> list[ItemOutcome]:
    """Each compared row's outcome, in ledger order."""
    under_traffic = next(iter(experiment.panel.under_traffic), None)
    found = []
    for record in rows:
        data = record.data
        if data.get("kind") == "prefix":
            continue
        if data["status"] != "ok":
            found.append(ItemOutcome(data["item_id"], data["precision"], False, True))
            continue
        row = experiment.read_row(data)
        if is_battery(row):
            found.append(battery_outcome(row))
            continue
        pairs = row.pairs
        changed = [a.suffix_sha256 != b.suffix_sha256 for a, b in pairs]
        left, right = pairs[0]
        index = first_divergence(left.suffix_token_ids, right.suffix_token_ids)
        numerics = [numeric_divergence(a.suffix, b.suffix) for a, b in pairs]
        parted = [n.index for n in numerics if n.parts and n.index is not None]
        found.append(
            ItemOutcome(
                item_id=data["item_id"],
                precision=data["precision"],
                reached=True,
                replicas_ok=row.replicas_exact,
                suffix_differs=len(pairs) == 1 and changed[0],
                answer_differs=any(a.answer != b.answer for a, b in pairs),
                label_flips=any(a.correct != b.correct for a, b in pairs),
                first_divergence=index,
                left_margin=left.margin_at(index),
                right_margin=right.margin_at(index),
                seeds_changed=sum(changed) if len(pairs) > 1 else None,
                seeds=len(pairs) if len(pairs) > 1 else None,
                cache_hit_tokens=left.served.cached_tokens[0] if left.served else None,
                logits_equal=all(a.logits_fingerprint == b.logits_fingerprint for a, b in pairs),
                kv_equal=row.comparison.cache_exact if row.comparison is not None else None,
                numerics_recorded=all(n.recorded for n in numerics),
                numeric_divergence=min(parted) if parted else None,
                **_under_traffic(
                    row.arms.get(under_traffic) if under_traffic else None, left, right
                ),
            )
        )
    return found


def battery_outcome(row: PanelRow) -> ItemOutcome:
    """A battery row at both levels: tokens part where any shape's hit and miss part
    (or read other cached tokens than they should, the calibration misses included),
    bits where any shape's numerics part; it diverges where a shape parts at the shape's
    own level. Its replicas hold when the calibration misses agree bit for bit."""
    shapes = [s for s in shape_outcomes(row) if s.ran and s.exercised is not False]
    pairs = [(s.hit, s.miss) for s in shapes]
    deterministic, phantom = calibration(row)
    reset = (RESET,) if phantom else ()
    parted = [s for s in shapes if not s.tokens_equal or not s.cache_as_written]
    first = next((s for s in shapes if s.detected), parted[0] if parted else None)
    steps = [s.first_step for s in shapes if not s.bits_equal and s.first_step is not None]
    return ItemOutcome(
        item_id=row.item_id,
        precision=row.precision,
        reached=True,
        replicas_ok=deterministic,
        suffix_differs=bool(parted) or bool(reset),
        answer_differs=any(a.answer != b.answer for a, b in pairs),  # type: ignore[union-attr]
        label_flips=any(a.correct != b.correct for a, b in pairs),  # type: ignore[union-attr]
        first_divergence=first.first_step if first is not None else None,
        cache_hit_tokens=max((s.hit_cached or 0 for s in shapes), default=0),
        logits_equal=all(a.logits_fingerprint == b.logits_fingerprint for a, b in pairs),  # type: ignore[union-attr]
        numerics_recorded=True,
        numeric_divergence=min(steps) if steps else None,
        detected=reset + tuple(s.shape for s in shapes if s.detected),
        shapes=[*_reset(phantom), *(s.to_json() for s in shape_outcomes(row))],
    )


RESET = "reset"
"""A battery's calibration as a shape: a miss after a reset that read cached tokens."""


def _reset(phantom: int) -> list[dict[str, Any]]:
    """The calibration where it detected a phantom hit (a verdict names it as a shape)."""
    if not phantom:
        return []
    why = f"a miss read {phantom} cached tokens after a reset"
    return [{"shape": RESET, "level": "tokens", "exercised": True, "detected": True, "why": why}]
