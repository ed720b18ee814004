"""The resample certificate (issue 14) on synthetic paired samples: its verdicts, and the
error rates of its equivalence tests checked by simulation (not by a model)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvreplay.measure.certificate import (
    ALPHA,
    FAITHFUL,
    NOT_FAITHFUL,
    UNDECIDED,
    Z_TOST,
    PairedSamples,
    accuracy_difference,
    certify,
    tv_distance,
)

MARGIN = 0.1
ANSWERS = np.array(["a", "b", "c"])


def paired(
    live: np.ndarray, prefill: np.ndarray, correct: tuple[str, ...] = ("a",), item: str = "x"
) -> PairedSamples:
    """Paired samples from two arrays of answers; correct where the answer is in ``correct``."""
    return PairedSamples(
        item=item,
        live=tuple(str(a) for a in live),
        prefill=tuple(str(a) for a in prefill),
        live_correct=tuple(bool(a in correct) for a in live),
        prefill_correct=tuple(bool(a in correct) for a in prefill),
        changed=tuple(bool(a != b) for a, b in zip(live, prefill, strict=True)),
    )


def draw(rng: np.random.Generator, p: list[float], k: int) -> np.ndarray:
    return rng.choice(ANSWERS, size=k, p=p)


def coupled(
    rng: np.random.Generator, live_p: list[float], prefill_p: list[float], k: int, keep: float
) -> tuple[np.ndarray, np.ndarray]:
    """A share ``keep`` of the seeds gives the prefill arm the live arm's own sample (the
    state did not change it); the rest draw from the distribution that makes the prefill
    arm's marginal ``prefill_p``."""
    rest = (np.array(prefill_p) - keep * np.array(live_p)) / (1 - keep)
    assert (rest >= 0).all()
    live = draw(rng, live_p, k)
    kept = rng.random(k) < keep
    return live, np.where(kept, live, draw(rng, list(rest), k))


def test_tv_distance() -> None:
    assert tv_distance(["a", "a"], ["a", "a"]) == 0
    assert tv_distance(["a", "a"], ["b", "b"]) == 1
    assert tv_distance(["a", "b", None, None], ["a", "a", None, "b"]) == pytest.approx(0.25)


def test_tv_distance_is_the_same_bits_under_every_hash_seed() -> None:
    """Outcomes are summed in set order, which follows PYTHONHASHSEED: the claims of one
    ledger must not change from one process to the next (ten answers whose plain float
    sum depends on their order)."""
    code = (
        "from kvreplay.measure.certificate import tv_distance;"
        "print(repr(tv_distance([f'a{i}' for i in range(7)] + ['b'] * 3,"
        " [f'c{i}' for i in range(3)] + ['a0'] * 8)))"
    )
    printed = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(8)
    }
    assert printed == {"0.9\n"}


def test_identical_sample_sets_are_certified_faithful() -> None:
    """A state against its own replica: every seed gives both arms the same sample."""
    rng = np.random.default_rng(0)
    items = [paired(*(2 * [draw(rng, [0.5, 0.3, 0.2], 40)]), item=f"i{i}") for i in range(4)]
    certificate = certify(items, MARGIN)
    assert certificate.verdict == FAITHFUL, certificate.sentence()
    assert certificate.measured.tv == 0 and certificate.tv_upper < MARGIN
    assert certificate.sentence().startswith("Faithful within the margin 0.1")


def test_states_that_differ_by_construction_are_not_faithful() -> None:
    rng = np.random.default_rng(1)
    items = [
        paired(draw(rng, [0.8, 0.1, 0.1], 30), draw(rng, [0.1, 0.1, 0.8], 30), item=f"i{i}")
        for i in range(3)
    ]
    certificate = certify(items, MARGIN)
    assert certificate.verdict == NOT_FAITHFUL, certificate.sentence()
    assert certificate.measured.permutation_p < ALPHA
    assert certificate.measured.tv_ci[0] > MARGIN


def test_too_few_samples_are_undecided_and_say_how_many_more() -> None:
    """Identical arms, but two seeds cannot bound the difference below the margin."""
    item = paired(np.array(["a", "b"]), np.array(["a", "b"]))
    certificate = certify([item], MARGIN)
    assert certificate.verdict == UNDECIDED
    assert certificate.more_samples is not None and certificate.more_samples > 10
    assert f"need about {certificate.more_samples} more samples" in certificate.sentence()
    # as many more as it asked for (and identical arms) is enough
    more = 2 + certificate.more_samples
    enough = paired(np.array(["a", "b"] * more), np.array(["a", "b"] * more))
    assert certify([enough], MARGIN).verdict == FAITHFUL


def test_certificate_is_deterministic_and_has_a_power_table() -> None:
    rng = np.random.default_rng(2)
    items = [paired(*coupled(rng, [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], 16, 0.5))]
    first, second = certify(items, 0.05).claims(), certify(items, 0.05).claims()
    assert first == second
    power = {row.margin: row.samples_per_item for row in first.power}
    assert set(power) == {0.02, 0.05, 0.1, 0.2}
    needed = [power[m].faithful or float("inf") for m in sorted(power)]
    assert needed == sorted(needed, reverse=True)  # a wider margin never needs more


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accuracy_tost_type_one_error_at_the_margin(seed: int) -> None:
    """True accuracy difference equal to the margin: equivalence is claimed at most
    about alpha of the time."""
    rng = np.random.default_rng(seed)
    trials, k, items = 2000, 100, 4
    claimed = 0
    for _ in range(trials):
        sets = [
            paired(draw(rng, [0.4, 0.3, 0.3], k), draw(rng, [0.4 + MARGIN, 0.3, 0.3 - MARGIN], k))
            for _ in range(items)
        ]
        difference, se = accuracy_difference(sets)
        claimed += abs(difference) + Z_TOST * se < MARGIN
    assert claimed / trials <= ALPHA + 3 * np.sqrt(ALPHA * (1 - ALPHA) / trials)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_faithful_verdict_error_rate_when_tv_equals_the_margin(seed: int) -> None:
    """Equal accuracy but answer distributions a margin apart in TV: the verdict says
    faithful at most about alpha of the time (the TV test alone must refuse it)."""
    rng = np.random.default_rng(seed)
    trials, k, items = 100, 200, 4
    live_p, prefill_p = [0.3, 0.3, 0.4], [0.3 + MARGIN, 0.3 - MARGIN, 0.4]
    faithful = 0
    for trial in range(trials):
        sets = [
            paired(*coupled(rng, live_p, prefill_p, k, 0.5), correct=("a", "b"))
            for _ in range(items)
        ]
        faithful += certify(sets, MARGIN, seed=trial, replicates=300).verdict == FAITHFUL
    assert faithful / trials <= ALPHA + 3 * np.sqrt(ALPHA * (1 - ALPHA) / trials)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_when_distributions_are_equal_and_samples_many(seed: int) -> None:
    """Equal distributions, half the seeds changed by the state, K = 800: faithful."""
    rng = np.random.default_rng(seed)
    trials, k, items = 20, 800, 4
    p = [0.5, 0.3, 0.2]
    faithful = sum(
        certify(
            [paired(*coupled(rng, p, p, k, 0.5)) for _ in range(items)],
            MARGIN,
            seed=trial,
            replicates=300,
        ).verdict
        == FAITHFUL
        for trial in range(trials)
    )
    assert faithful / trials >= 0.8
