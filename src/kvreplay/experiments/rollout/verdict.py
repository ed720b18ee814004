"""The mismatch verdict (design: check, level, power, mismatch): a rollout stack's
log-probabilities of the tokens it sampled, judged against a trainer's teacher-forced
ones, at two levels.

The *bits* level asks whether every token's two log-probabilities are the same float
(what a bitwise-aligned pair of stacks promises: its KL is exactly 0); the *numbers*
level asks whether the mismatch stays within what the expectation allows: the k3 KL
estimator at most ``max_k3_kl`` and no token's |delta log p| above ``max_abs_logp``
(:mod:`kvreplay.experiments.rollout.metrics` defines both). A verdict names the level it holds at,
reports the other, and states its power: at the bits level the exact 95% upper bound on
the rate of sequences whose log-probabilities part (0 of n rules out no more than
that), at the numbers level the 95% upper bound of the k3 KL over resampled sequences
and of the rate of tokens beyond ``max_abs_logp``. Exit 0 holds, 1 does not, 2 refused;
JSON (schema ``kvreplay-mismatch-v1``) and JUnit carry the rest. The verdict is a value
of its own beside :mod:`kvreplay.verify.verdict` (the live vs prefill check's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import option
from kvreplay.core.power import rate_upper_bound
from kvreplay.experiments.rollout.claims import GroupClaims
from kvreplay.experiments.rollout.metrics import SequenceOutcome
from kvreplay.experiments.rollout.tally import Measured

SCHEMA = "kvreplay-mismatch-v1"
DEFAULT_MAX_K3_KL = 1e-3
"""The numbers level's default: RL practice reads a k3 KL around 1e-3 as a healthy
dense-model pair and 1e-2 as significantly off-policy."""
HOLDS, FAILS = 0, 1
MAX_GATE = 1e6  # a gate's bound: far past any mismatch two stacks of one model show


@dataclass(frozen=True)
class MismatchBounds:
    """The bounds a mismatch gate is given (``check --trainer``, ``kvreplay mismatch``),
    each option declared once here."""

    max_k3_kl: float | None = field(
        default=None,
        metadata=option(
            "--max-k3-kl",
            "A mismatch gate: the largest k3 KL estimate that passes "
            f"(default {DEFAULT_MAX_K3_KL:g}).",
            minimum=0,
            maximum=MAX_GATE,
        ),
    )
    max_abs_logp: float | None = field(
        default=None,
        metadata=option(
            "--max-abs-logp",
            "A mismatch gate: the largest |delta log p| any token may have.",
            minimum=0,
            maximum=MAX_GATE,
        ),
    )
    fail_on_growth: bool = field(
        default=False,
        metadata=option(
            "--fail-on-growth",
            "A mismatch gate on rollouts logged with steps: fail when the trainer's k3 KL "
            "grows step over step (the trend's alarm).",
        ),
    )

    @property
    def given(self) -> bool:
        return self.max_k3_kl is not None or self.max_abs_logp is not None or self.fail_on_growth


@dataclass(frozen=True)
class MismatchExpectation:
    """What the pair should do: ``bitwise`` (the bits level), or stay within
    ``max_k3_kl`` and ``max_abs_logp`` (the numbers level; None: not asked); and with
    ``growth``, not grow step over step (the trend's alarm)."""

    bitwise: bool = False
    max_k3_kl: float | None = DEFAULT_MAX_K3_KL
    max_abs_logp: float | None = None
    growth: bool = False

    def __post_init__(self) -> None:
        """A bound is a finite number of at least 0 (a NaN bound would pass nothing and
        say "at most nan"), however the expectation was made."""
        for name, value in (("max_k3_kl", self.max_k3_kl), ("max_abs_logp", self.max_abs_logp)):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and value >= 0):
                raise KvreplayError(
                    f"The expectation's {name} is {repr(value)[:20]}, not a finite number of "
                    "at least 0."
                )

    @property
    def level(self) -> str:
        return "bits" if self.bitwise else "numbers"

    def describe(self) -> str:
        bounds = []
        if self.bitwise:
            bounds.append("every token's log-probability the same float")
        if self.max_k3_kl is not None:
            bounds.append(f"k3 KL at most {self.max_k3_kl:g}")
        if self.max_abs_logp is not None:
            bounds.append(f"every |delta log p| at most {self.max_abs_logp:g}")
        if self.growth:
            bounds.append("no growth of the k3 KL step over step")
        return " and ".join(bounds)


def parse_expectation(expect: str | None, bounds: MismatchBounds) -> MismatchExpectation:
    """The expectation of a mismatch check: ``--expect bitwise``, or bounds (the k3 KL at
    most :data:`DEFAULT_MAX_K3_KL` when none is given), either with ``--fail-on-growth``;
    bad values and combinations refused in one sentence."""
    max_k3_kl, max_abs_logp, growth = bounds.max_k3_kl, bounds.max_abs_logp, bounds.fail_on_growth
    if expect not in (None, "bitwise"):
        raise KvreplayError(
            f"--expect {expect} judges live vs prefill continuations; a --trainer check takes "
            "--expect bitwise, --max-k3-kl or --max-abs-logp."
        )
    for flag, value in (("--max-k3-kl", max_k3_kl), ("--max-abs-logp", max_abs_logp)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise KvreplayError(f"{flag} must be a finite number of at least 0; got {value:g}.")
    if expect == "bitwise":
        if max_k3_kl is not None or max_abs_logp is not None:
            raise KvreplayError(
                "--expect bitwise asks for equal floats; --max-k3-kl and --max-abs-logp bound "
                "a mismatch instead: give one or the other."
            )
        return MismatchExpectation(bitwise=True, max_k3_kl=None, growth=growth)
    if max_k3_kl is None and max_abs_logp is None:
        return MismatchExpectation(growth=growth)
    return MismatchExpectation(False, max_k3_kl, max_abs_logp, growth)


@dataclass
class MismatchVerdict:
    """A mismatch check's outcome: both levels, the power, each sequence, and the
    section's claims per precision (metrics, decomposition, controls)."""

    expectation: MismatchExpectation
    rollout: str
    trainer: str
    sequences: list[SequenceOutcome]
    kl_k3: float
    kl_k3_upper: float | None
    abs_logp_max: float
    claims: dict[str, GroupClaims] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def alarms(self) -> list[str]:
        """The groups whose trainer's k3 KL grows step over step (the trend's alarm)."""
        return [
            group
            for group, c in self.claims.items()
            if (steps := (c.steps or {}).get(self.trainer)) is not None and steps.trend.alarm
        ]

    @property
    def grows(self) -> bool:
        """Whether a growth that the expectation forbids was found."""
        return self.expectation.growth and bool(self.alarms)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sequences)

    @property
    def parted(self) -> list[SequenceOutcome]:
        return [s for s in self.sequences if not s.bits_equal]

    @property
    def bits_hold(self) -> bool:
        return bool(self.sequences) and not self.parted

    @property
    def beyond(self) -> int:
        """Sequences with a token beyond ``max_abs_logp`` (0 when it is not asked)."""
        bound = self.expectation.max_abs_logp
        return 0 if bound is None else sum(s.abs_logp_max > bound for s in self.sequences)

    @property
    def numbers_hold(self) -> bool:
        e = self.expectation
        k3 = e.max_k3_kl is None or self.kl_k3 <= e.max_k3_kl
        return bool(self.sequences) and k3 and self.beyond == 0

    @property
    def holds(self) -> bool:
        level = self.bits_hold if self.expectation.bitwise else self.numbers_hold
        return level and not self.grows

    @property
    def exit_code(self) -> int:
        return HOLDS if self.holds else FAILS

    def levels(self) -> dict[str, Any]:
        n = len(self.sequences)
        first = self.parted[0] if self.parted else None
        e = self.expectation
        return {
            "bits": {
                "holds": self.bits_hold,
                "sequences": n,
                "differ": len(self.parted),
                "first": None if first is None else {
                    "sequence": first.key, "token": first.first_differs,
                    "precision": first.precision,
                },
                "rate_upper_95": rate_upper_bound(len(self.parted), n),
            },
            "numbers": {
                "holds": self.numbers_hold,
                "tokens": self.tokens,
                "kl_k3": self.kl_k3,
                "kl_k3_upper_95": self.kl_k3_upper,
                "max_k3_kl": e.max_k3_kl,
                "abs_logp_max": self.abs_logp_max,
                "max_abs_logp": e.max_abs_logp,
                "sequences_beyond": self.beyond,
                "rate_beyond_upper_95": rate_upper_bound(self.beyond, n)
                if e.max_abs_logp is not None
                else None,
            },
            "trend": {"asked": e.growth, "holds": not self.grows, "alarms": self.alarms},
        }  # fmt: skip

    def passes(self, outcome: SequenceOutcome) -> bool:
        """Whether one sequence meets what can be judged of it alone (bits, or its
        largest |delta log p|)."""
        if self.expectation.bitwise:
            return outcome.bits_equal
        bound = self.expectation.max_abs_logp
        return bound is None or outcome.abs_logp_max <= bound


def judge(
    measured: Measured,
    trainer: str,
    expectation: MismatchExpectation,
    rollout: str,
    environment: dict[str, Any] | None = None,
) -> MismatchVerdict:
    """The verdict of measured rollouts (:func:`~kvreplay.experiments.rollout.tally.measure`
    with this ``trainer``): the rollout's log-probabilities against the trainer's (a
    scorer's label), pooled over the groups; the section's claims beside it."""
    pooled = measured.pooled
    assert pooled is not None, "measure the rollouts with the trainer to judge them"
    claims = measured.claims()
    interval = pooled.k3_interval()
    return MismatchVerdict(
        expectation, rollout, trainer, pooled.outcomes, pooled.kl_k3,
        None if interval is None else interval.high,
        pooled.largest if pooled.outcomes else math.nan, claims, environment or {},
    )  # fmt: skip
