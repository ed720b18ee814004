"""Each statistic against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from kvreplay.measure import stats
from kvreplay.measure.stats import (
    BOOTSTRAP_BLOCK,
    BOOTSTRAP_REPLICATES,
    BOOTSTRAP_SEED,
    MAX_BLOCK_CELLS,
    bootstrap_index_blocks,
    mcnemar_exact_p,
    newcombe_paired_difference_ci,
    paired_bootstrap_ci_pp,
    wilson_interval,
)

HAND = 1e-6  # hand arithmetic carried to about seven significant figures


def test_wilson_empty_sample_is_zero_zero() -> None:
    assert wilson_interval(0, 0) == (0.0, 0.0)


def test_wilson_five_of_ten() -> None:
    # z = 1.96, z^2 = 3.8416, p = 0.5, n = 10
    # denominator = 1 + 3.8416/10 = 1.38416
    # centre = (0.5 + 3.8416/20) / 1.38416 = 0.69208 / 1.38416 = 0.5
    # half = 1.96 * sqrt(0.25/10 + 3.8416/400) / 1.38416
    #      = 1.96 * sqrt(0.034604) / 1.38416 = 1.96 * 0.1860215 / 1.38416 = 0.2634104
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.5 - 0.2634104, abs=HAND)
    assert high == pytest.approx(0.5 + 0.2634104, abs=HAND)


def test_wilson_four_of_ten() -> None:
    # p = 0.4: centre = (0.4 + 0.19208) / 1.38416 = 0.4277540
    # half = 1.96 * sqrt(0.024 + 0.009604) / 1.38416 = 1.96 * 0.1833139 / 1.38416 = 0.2595765
    low, high = wilson_interval(4, 10)
    assert low == pytest.approx(0.4277540 - 0.2595765, abs=HAND)
    assert high == pytest.approx(0.4277540 + 0.2595765, abs=HAND)


def test_wilson_zero_of_200_is_the_papers_fp32_bound() -> None:
    # count 0: centre = half = (z^2 / 2n) / (1 + z^2 / n), so low = 0 and
    # high = (z^2 / n) / (1 + z^2 / n) = 0.019208 / 1.019208 = 0.0188460
    low, high = wilson_interval(0, 200)
    assert low == 0.0
    assert high == pytest.approx(0.019208 / 1.019208, rel=1e-12)
    assert round(high, 5) == 0.01885


def test_wilson_all_successes_mirrors_zero_and_clips_at_one() -> None:
    # 10/10 mirrors 0/10: low = 1 - (0.38416 / 1.38416) = 1 - 0.2775402 = 0.7224598
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(0.7224598, abs=HAND)
    assert high == 1.0


def test_wilson_z_is_configurable() -> None:
    # z = 1, 0 of 1: denominator = 2, centre = (1/2) / 2 = 0.25, half = sqrt(1/4) / 2 = 0.25
    assert wilson_interval(0, 1, z=1.0) == pytest.approx((0.0, 0.5))
    # the transplant z differs from 1.96 only after the fourth decimal
    assert wilson_interval(24, 24, z=1.959963984540054)[0] == pytest.approx(
        wilson_interval(24, 24)[0], abs=1e-5
    )
    assert wilson_interval(24, 24, z=1.959963984540054) != wilson_interval(24, 24)


def test_mcnemar_no_discordant_pairs_is_one() -> None:
    assert mcnemar_exact_p(0, 0) == 1.0


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        # N = 5, min = 0: 2 * C(5,0) / 2^5 = 2/32
        (0, 5, 0.0625),
        # N = 5, min = 1: 2 * (1 + 5) / 32 = 12/32
        (1, 4, 0.375),
        (4, 1, 0.375),
        # N = 6, min = 3: 2 * (1 + 6 + 15 + 20) / 64 = 84/64 > 1, capped at 1
        (3, 3, 1.0),
        # N = 20, min = 9: sum_{k<=9} C(20,k) = (2^20 - C(20,10)) / 2 = (1048576 - 184756) / 2
        # = 431910; p = 2 * 431910 / 1048576 = 0.823802947998046875 (the paper's BF16 9 vs 11)
        (9, 11, 863820 / 1048576),
        # N = 166, min = 0: 2 / 2^166 = 2^-165, far below float underflow of naive products
        (0, 166, 2.0**-165),
    ],
)
def test_mcnemar_exact_two_sided(b: int, c: int, expected: float) -> None:
    assert mcnemar_exact_p(b, c) == pytest.approx(expected, rel=1e-15)


def test_bootstrap_single_row_is_that_row_times_100() -> None:
    # n = 1: every draw picks row 0, so every replicate mean is 0.25 -> 25 pp
    assert paired_bootstrap_ci_pp([0.25], stream=5) == (25.0, 25.0)


def test_bootstrap_constant_vector_has_zero_width() -> None:
    assert paired_bootstrap_ci_pp(np.ones(200), stream=0) == (100.0, 100.0)


def test_bootstrap_two_rows_spans_zero_to_hundred() -> None:
    # x = [0, 1]: a replicate mean is 0, 0.5 or 1 with chances 1/4, 1/2, 1/4, so
    # about 5,000 of 20,000 replicates are 0 and 5,000 are 1; the 2.5% and 97.5%
    # quantiles therefore land on 0 and 100.
    assert paired_bootstrap_ci_pp([0, 1], stream=0) == (0.0, 100.0)


def test_bootstrap_draws_follow_method_md_literally() -> None:
    """A literal transcription of the paper's published bootstrap (paper-release's method,
    outside this repository; docs/design.md): one integers() call per block of 1,000."""
    values = np.random.default_rng(7).normal(size=60)  # continuous, so streams cannot tie
    stream = 101
    rng = np.random.default_rng(BOOTSTRAP_SEED + stream)
    replicates = []
    for _ in range(BOOTSTRAP_REPLICATES // BOOTSTRAP_BLOCK):
        rows = rng.integers(0, values.size, size=(BOOTSTRAP_BLOCK, values.size))
        replicates.extend(values[row].mean() for row in rows)
    expected = np.quantile(np.array(replicates) * 100, [0.025, 0.975])
    assert paired_bootstrap_ci_pp(values, stream) == (expected[0], expected[1])
    assert paired_bootstrap_ci_pp(values, stream + 1) != (expected[0], expected[1])


def test_bootstrap_of_many_rows_draws_in_bounded_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: a million rows would need 7.45 GiB for one block of 1,000 resamples.
    Blocks are cut to MAX_BLOCK_CELLS indices, and a cut changes no draw: the interval
    with blocks of 7 resamples (20,000 is no multiple of 7) is the one of blocks of 1,000."""
    first = next(bootstrap_index_blocks(100_000, stream=0))
    assert first.shape == (MAX_BLOCK_CELLS // 100_000, 100_000)
    assert next(bootstrap_index_blocks(1_000_000, stream=0)).shape == (1, 1_000_000)
    values = np.random.default_rng(3).normal(size=60)
    whole = paired_bootstrap_ci_pp(values, stream=4)
    monkeypatch.setattr(stats, "MAX_BLOCK_CELLS", 7 * values.size)
    blocks = list(bootstrap_index_blocks(values.size, stream=4))
    assert max(b.size for b in blocks) == 7 * values.size
    assert sum(b.shape[0] for b in blocks) == BOOTSTRAP_REPLICATES
    assert paired_bootstrap_ci_pp(values, stream=4) == whole


def test_bootstrap_rejects_empty_vector() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        paired_bootstrap_ci_pp([], stream=0)


def test_newcombe_general_table() -> None:
    # pairs (x, y): a = 3 (1,1), b = 2 (1,0), c = 1 (0,1), d = 4 (0,0); n = 10
    # p1 = 5/10 = 0.5, p2 = 4/10 = 0.4, theta = 0.1
    # Wilson(5,10) = (0.2365896, 0.7634104); Wilson(4,10) = (0.1681776, 0.6873305)
    # phi = (ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d)) = (12 - 2) / sqrt(5*5*4*6) = 0.4082483
    # delta^2 = 0.2634104^2 - 2*0.4082483*0.2634104*0.2873305 + 0.2873305^2
    #         = 0.0693851 - 0.0617967 + 0.0825588 = 0.0901472 -> delta = 0.3002452
    # eps^2   = 0.2634104^2 - 2*0.4082483*0.2634104*0.2318224 + 0.2318224^2
    #         = 0.0693851 - 0.0498590 + 0.0537417 = 0.0732678 -> eps = 0.2706803
    # interval = (0.1 - 0.3002452, 0.1 + 0.2706803) = (-0.2002452, 0.3706803)
    first = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    second = [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    low, high = newcombe_paired_difference_ci(first, second)
    assert low == pytest.approx(-0.2002452, abs=HAND)
    assert high == pytest.approx(0.3706803, abs=HAND)


def test_newcombe_empty_margin_uses_phi_zero() -> None:
    # all pairs (1,1): c + d = 0 so phi = 0; p1 = p2 = 1 and Wilson(10,10) low = 0.7224598,
    # so delta = 1 - 0.7224598 (from p1's interval), eps = 1 - 0.7224598 (from p2's)
    low, high = newcombe_paired_difference_ci([1] * 10, [1] * 10)
    assert low == pytest.approx(-0.2775402, abs=HAND)
    assert high == pytest.approx(0.2775402, abs=HAND)


def test_newcombe_is_antisymmetric_in_its_arguments() -> None:
    first = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    second = [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    low, high = newcombe_paired_difference_ci(first, second)
    assert newcombe_paired_difference_ci(second, first) == pytest.approx((-high, -low))


def test_newcombe_rejects_unpaired_vectors() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        newcombe_paired_difference_ci([1, 0], [1])
