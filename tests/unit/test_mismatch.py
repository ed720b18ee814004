"""The mismatch metrics, each against its definition computed by hand (issue 44), the
exact decomposition, and the sampling settings whose log-probabilities are ambiguous."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvreplay.backends.rollout import ScorerSpec, parse_scorers
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Sampling, Scored, Turn
from kvreplay.experiments.rollout.metrics import (
    METRIC_NAMES,
    Pairs,
    by_margin,
    by_position,
    decompose,
    first_argmax_divergence,
    metrics,
    term_interval,
)

ROLLOUT = [[-0.5, -1.0, -2.0], [-0.1, -3.0]]
SCORER = [[-0.5, -1.5, -1.0], [-0.2, -3.0]]


def test_each_metric_is_its_definition() -> None:
    found = metrics(Pairs.of(ROLLOUT, SCORER), cap=2.0)
    r, s = np.concatenate(ROLLOUT), np.concatenate(SCORER)
    d = s - r
    assert set(found) == set(METRIC_NAMES)
    assert found["tokens"] == 5 and found["sequences"] == 2
    assert found["abs_logp_mean"] == pytest.approx(np.mean(np.abs(d)))
    assert found["abs_logp_max"] == 1.0
    assert found["kl_k1"] == pytest.approx(np.mean(r - s))
    assert found["kl_k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d))
    diff = np.abs(np.exp(s) - np.exp(r))
    assert found["probs_diff_max"] == pytest.approx(diff.max())
    assert found["probs_diff_std"] == pytest.approx(np.std(diff, ddof=1))  # as torch.std
    assert found["probs_pearson"] == pytest.approx(np.corrcoef(np.exp(r), np.exp(s))[0, 1])
    assert found["seq_log_ratio_mean"] == pytest.approx((0.5 - 0.1) / 2)
    assert found["seq_log_ratio_abs_max"] == pytest.approx(0.5)
    assert found["ratio_above_cap"] == pytest.approx(1 / 5)  # exp(1) > 2
    assert found["ratio_outside_cap"] == pytest.approx(1 / 5)  # exp(-0.5) is within [1/2, 2]
    assert found["ratio_q50"] == pytest.approx(1.0)
    assert found["tokens_bit_equal"] == pytest.approx(2 / 5)
    # verl's perplexities: each sequence's, then their mean
    ppl = np.mean([math.exp(-np.mean(x)) for x in ROLLOUT])
    assert found["ppl_rollout"] == pytest.approx(ppl)


def test_a_constant_side_has_no_correlation() -> None:
    found = metrics(Pairs.of([[-1.0, -1.0]], [[-1.0, -2.0]]))
    assert found["probs_pearson"] is None


def test_where_and_at_what_gap_the_differences_sit() -> None:
    pairs = Pairs.of([[0.0] * 8], [[0.0] * 7 + [-1.0]], [[0.05] * 7 + [3.0]])
    positions = by_position(pairs)
    assert [b["large"] for b in positions] == [0] * 7 + [1]  # |delta| 1 > log 2
    gaps = by_margin(pairs)
    assert gaps[0]["tokens"] == 7 and gaps[4]["large"] == 1
    assert gaps[-1]["margin_to"] is None  # the last bin is open, and JSON has no Infinity


def test_first_argmax_divergence() -> None:
    assert first_argmax_divergence([[4, 7], [2, 9]]) == 2
    assert first_argmax_divergence([]) is None


def test_the_terms_add_up_to_the_total_exactly() -> None:
    rng = np.random.default_rng(0)
    sides = [
        [list(rng.uniform(-20, 0, 50).astype(np.float32).astype(float)) for _ in range(3)]
        for _ in range(3)
    ]
    d = decompose([("rollout", sides[0]), ("engine", sides[1]), ("trainer", sides[2])])
    assert d.names == ("engine", "trainer")
    assert np.array_equal(d.terms[0] + d.terms[1], d.total)


def test_paired_intervals_share_their_resamples() -> None:
    values = np.array([1.0, 2.0, 3.0, 4.0])
    sequence = np.array([0, 0, 1, 1])
    first = term_interval(values, sequence, 7)
    again = term_interval(values, sequence, 7)
    assert first == again and first is not None and first.low <= 2.5 <= first.high


@pytest.mark.parametrize(
    ("sampling", "reports", "expected"),
    [
        (Sampling(0.0, logprobs="processed"), ("raw", "processed"), "point mass"),
        (Sampling(0.7, top_p=0.9, logprobs="processed"), ("raw", "processed"), "truncation"),
        (Sampling(0.7, top_k=20, logprobs="processed"), ("raw", "processed"), "truncation"),
        (Sampling(0.7, logprobs="processed"), ("raw",), "reports raw log-probabilities"),
        (Sampling(0.7), (), "reports neither"),
    ],
)
def test_ambiguous_log_probabilities_are_refused(
    sampling: Sampling, reports: tuple[str, ...], expected: str
) -> None:
    with pytest.raises(KvreplayError, match=expected):
        sampling.check(reports, "the stack")


def test_unambiguous_settings_pass() -> None:
    Sampling(1.0, logprobs="processed").check(("raw",), "s")  # T = 1, no cut: the same number
    Sampling(0.0).check(("raw",), "s")
    Sampling(0.7, top_p=0.9).check(("raw",), "s")


def test_turns_and_scores_refuse_values_that_are_no_log_probability() -> None:
    with pytest.raises(KvreplayError, match="not a finite number at most 0"):
        Turn([1, 2], [-0.1, math.nan])
    with pytest.raises(KvreplayError, match="not a finite number at most 0"):
        Turn([1], [math.inf])
    with pytest.raises(KvreplayError, match="2 log-probabilities for 1 tokens"):
        Turn([1], [-0.1, -0.2])
    with pytest.raises(KvreplayError, match="gaps"):
        Scored([-0.1], [0.1, 0.2])


def test_scorer_specs() -> None:
    assert ScorerSpec.parse("hf:fp32").label == "hf:fp32"
    assert ScorerSpec.parse("hf:bf16:replay").schedule == "replay"
    assert ScorerSpec.parse("engine:replay").label == "engine:replay"
    assert ScorerSpec.parse("hf:fp32@/m").model == "/m"
    for bad, why in (
        ("hf", "not engine or BACKEND"),
        ("hf:fp8", "runs fp32, bf16, fp16, not fp8"),
        ("hf:fp32:chunked", "schedule is prefill or replay"),
        ("nope:fp32", "Unknown backend"),
    ):
        with pytest.raises(KvreplayError, match=why):
            ScorerSpec.parse(bad)
    with pytest.raises(KvreplayError, match="twice"):
        parse_scorers("hf:fp32,hf:fp32")


def test_a_followup_is_what_the_chat_template_puts_between_two_answers() -> None:
    from tiny import byte_tokenizer

    from kvreplay.experiments.rollout.experiment import followup_ids

    tokenizer = byte_tokenizer()
    ids = followup_ids(tokenizer, "Again?", None)
    assert tokenizer.decode(ids) == "\n<|user|>Again?\n<|assistant|>"
    assert tokenizer.decode(followup_ids(tokenizer, "Again?", False)) == "\nAgain?"
