"""The rollout section's claims as types (design: typed claims): what the one-pass tally
(:mod:`kvreplay.experiments.rollout.tally`) says of each group of rollouts, read by the
summary, the report, the verdict and the gate as fields. claims.json is their encoding
(:func:`kvreplay.core.claims.encode`); a key that is absent in some runs (a mask's kept
tokens, steps, environments, a control that shared no token) is an ``omit`` field.

A scorer's metrics stay a mapping: its keys are the declared metric registry
(:data:`kvreplay.experiments.rollout.metrics.METRICS`), not claims of this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.core.claims import Json, decode, encode, key

SECTION = "rollout_mismatch"
Interval = list[float]
"""A 95% interval, [low, high]."""


@dataclass(frozen=True)
class Term:
    """One term of a decomposition (or its total): the per-token mean of delta, signed
    and absolute, with paired 95% intervals over resampled sequences, its largest
    magnitude and how many tokens it moved."""

    mean: float
    ci95: Interval | None
    abs_mean: float
    abs_ci95: Interval | None
    max_abs: float
    tokens_moved: int


@dataclass(frozen=True)
class Comparison:
    """How much more the leading term moves log-probabilities than the next one."""

    over: str
    abs_mean_difference: float
    ci95: Interval | None
    decided: bool  # the interval of the difference lies above 0


@dataclass(frozen=True)
class Lead:
    """The term that moves log-probabilities most (compared where there are two)."""

    term: str
    comparison: Comparison | None = field(default=None, metadata=key(flatten=True, omit=True))


@dataclass(frozen=True)
class Split:
    """Terms that add up to a total (bit for bit where ``exact``)."""

    terms: dict[str, Term]
    total: Term
    dominant: Lead
    exact: bool


@dataclass(frozen=True)
class Decomposition:
    """A trainer's total split into the engine's own term and the cross-stack term."""

    tokens: int
    sequences: int
    split: Split = field(metadata=key(flatten=True))


@dataclass(frozen=True)
class Control:
    """A control against the rollout (a prefix-cache miss, a batch): its term alone,
    the cached tokens of each side and the chains through it to each trainer; a control
    that shared no token with the rollout says so with ``tokens`` 0."""

    term: str
    sequences: int
    tokens: int
    split: Split | None = field(default=None, metadata=key(flatten=True, omit=True))
    cached_tokens: dict[str, list[int | None]] | None = field(default=None, metadata=key(omit=True))
    chains: dict[str, Decomposition] | None = field(default=None, metadata=key(omit=True))


@dataclass(frozen=True)
class Bin:
    """Tokens in one bin: how many, their mean and largest |delta|, how many are large."""

    tokens: int
    abs_logp_mean: float | None
    abs_logp_max: float | None
    large: int


@dataclass(frozen=True)
class PositionBin(Bin):
    eighth: int  # of each sequence's length


@dataclass(frozen=True)
class MarginBin(Bin):
    margin_from: float  # the scorer's top-1/top-2 gap
    margin_to: float | None  # None: the last bin, open


@dataclass(frozen=True)
class Argmax:
    """Where the scorer's argmax is not the sampled token (greedy rollouts)."""

    greedy: bool
    sequences: int
    sequences_parted: int
    first_index_median: float | None


@dataclass(frozen=True)
class Scorer:
    """One scorer against the rollout: its metrics, by the metric registry's names, and
    where its differences sit."""

    metrics: dict[str, float | None]
    by_position: list[PositionBin]
    by_margin: list[MarginBin]
    argmax: Argmax


@dataclass(frozen=True)
class StepCounts:
    """The mismatch of one step (or environment): enough for a trend."""

    sequences: int
    tokens: int
    kl_k3: float
    abs_logp_mean: float
    seq_truncated_verl: int
    seq_masked_trl: int


@dataclass(frozen=True)
class StepRow(StepCounts):
    step: int


@dataclass(frozen=True)
class Trend:
    """The Mann-Kendall test of the k3 KL in step order (see metrics.trend)."""

    steps: int
    s: int
    tau: float | None
    p_value: float | None
    slope_per_step: float | None
    alarm: bool
    first: float | None = field(default=None, metadata=key(omit=True))
    last: float | None = field(default=None, metadata=key(omit=True))


@dataclass(frozen=True)
class Steps:
    by_step: list[StepRow]
    trend: Trend


@dataclass(frozen=True)
class Mode:
    """How a side's log-probabilities were logged."""

    mode: str | None
    temperature: float | None


@dataclass(frozen=True)
class GroupClaims:
    """What the section says of one group (a rollout stack's precision, or ``logged``)."""

    temperature: float | None
    sequences: int
    tokens: int
    scorers: dict[str, Scorer]
    decomposition: dict[str, Decomposition]
    controls: dict[str, Control]
    kept_tokens: int | None = field(default=None, metadata=key(omit=True))
    logprobs: dict[str, list[Mode]] | None = field(default=None, metadata=key(omit=True))
    steps: dict[str, Steps] | None = field(default=None, metadata=key(omit=True))
    environments: dict[str, dict[str, StepCounts]] | None = field(
        default=None, metadata=key(omit=True)
    )


@dataclass(frozen=True)
class RolloutClaims:
    """The section's claims, by group."""

    precisions: dict[str, GroupClaims] = field(metadata=key(SECTION))


def typed(groups: Json) -> dict[str, GroupClaims]:
    """The tally's claims of each group as their types (a defect is a ClaimsError)."""
    found = decode(RolloutClaims, {SECTION: groups})
    return {} if found is None else found.precisions


def plain(groups: dict[str, GroupClaims]) -> Json:
    """The groups' claims as claims.json writes them (a mismatch's --json too)."""
    return encode(RolloutClaims(groups))[SECTION]
