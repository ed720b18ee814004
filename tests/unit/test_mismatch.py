"""The mismatch metrics, each against its definition computed by hand (issues 44, 51),
token- and sequence-level; the same numbers however the stream is cut; the exact
decomposition and its tolerance for log-probabilities that are not float32; intervals,
exact sums and order statistics; the trend's alarm; and the sampling settings whose
log-probabilities are ambiguous."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from kvreplay.backends.rollout import ScorerSpec, parse_scorers
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import LOGPROB_FLOOR, Sampling, Scored, Turn
from kvreplay.experiments.rollout import metrics as module
from kvreplay.experiments.rollout.metrics import (
    METRIC_NAMES,
    ChainTally,
    OutcomeTally,
    PairTally,
    first_argmax_divergence,
    metrics,
    trend,
)
from kvreplay.measure import streamed
from kvreplay.measure.streamed import Spill, mean_interval, quantiles

ROLLOUT = [[-0.5, -1.0, -2.0], [-0.1, -3.0]]
SCORER = [[-0.5, -1.5, -1.0], [-0.2, -3.0]]


def tally(rollout: list[list[float]], scorer: list[list[float]], margins=None) -> PairTally:
    pair = PairTally("g")
    for i, (r, s) in enumerate(zip(rollout, scorer, strict=True)):
        gaps = None if margins is None else np.asarray(margins[i], dtype=float)
        pair.add(np.asarray(r, dtype=float), np.asarray(s, dtype=float), np.arange(len(r)),
                 len(r), gaps)  # fmt: skip
    return pair


def test_each_metric_is_its_definition() -> None:
    found = metrics(tally(ROLLOUT, SCORER).totals())
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
    assert found["token_mult_prob_error"] == pytest.approx(np.mean(np.exp(np.abs(d))))


def test_the_sequence_level_metrics_are_their_frameworks_definitions() -> None:
    rng = np.random.default_rng(3)
    rollout = [list(-rng.exponential(1, n)) for n in (5, 40, 9, 120)]
    scorer = [list(np.minimum(np.array(x) + rng.normal(0, 0.08, len(x)), 0)) for x in rollout]
    found = metrics(tally(rollout, scorer).totals())
    sums = np.array(
        [np.sum(np.array(s) - np.array(r)) for r, s in zip(rollout, scorer, strict=True)]
    )
    means = np.array(
        [np.mean(np.array(s) - np.array(r)) for r, s in zip(rollout, scorer, strict=True)]
    )
    assert found["seq_ratio_min"] == pytest.approx(np.exp(sums.min()))
    assert found["seq_ratio_max"] == pytest.approx(np.exp(sums.max()))
    assert found["seq_ratio_median"] == pytest.approx(np.exp(np.median(sums)))
    assert found["seq_geo_ratio_min"] == pytest.approx(np.exp(means.min()))
    assert found["seq_truncated_verl"] == np.count_nonzero(sums > math.log(2))  # verl TIS, 2
    assert found["seq_masked_trl"] == np.count_nonzero(np.exp(sums) > 3)  # TRL sequence_mask
    assert found["chi2_seq"] == pytest.approx(np.mean(np.exp(2 * sums)) - 1)
    w = np.exp(sums)
    assert found["ess_seq"] == pytest.approx(w.sum() ** 2 / (w.size * (w**2).sum()))


def test_a_constant_side_has_no_correlation() -> None:
    found = metrics(tally([[-1.0, -1.0]], [[-1.0, -2.0]]).totals())
    assert found["probs_pearson"] is None


def test_where_and_at_what_gap_the_differences_sit() -> None:
    pair = tally([[0.0] * 8], [[0.0] * 7 + [-1.0]], [[0.05] * 7 + [3.0]])
    pair.totals()
    assert [b["large"] for b in pair.by_position()] == [0] * 7 + [1]  # |delta| 1 > log 2
    gaps = pair.by_margin()
    assert gaps[0]["tokens"] == 7 and gaps[4]["large"] == 1
    assert gaps[-1]["margin_to"] is None  # the last bin is open, and JSON has no Infinity


def test_each_sequence_is_judged_alone() -> None:
    judged = OutcomeTally()
    for i, (r, s) in enumerate([([-0.1, -0.2], [-0.1, -0.25]), ([-0.3], [-0.3])]):
        judged.add(np.array(r), np.array(s), np.arange(len(r)), f"s{i}", "g", {"step": i})
    first, second = judged.outcomes
    assert (first.key, first.first_differs, second.first_differs) == ("s0", 1, None)
    assert first.abs_logp_max == pytest.approx(0.05) and second.where == {"step": 1}
    d = np.array([0.0, -0.05, 0.0])
    assert judged.kl_k3 == pytest.approx(np.mean(np.expm1(d) - d))


def test_the_numbers_do_not_depend_on_how_the_stream_is_cut(monkeypatch) -> None:
    """The same rollouts read again give the same numbers bit for bit; read in other
    blocks, the same counts, extremes and quantiles, and sums within rounding."""
    rng = np.random.default_rng(1)
    rollout = [list(-rng.exponential(1, n)) for n in rng.integers(1, 300, 40)]
    scorer = [list(np.minimum(np.array(x) + rng.normal(0, 0.05, len(x)), 0)) for x in rollout]
    whole = metrics(tally(rollout, scorer).totals())
    assert metrics(tally(rollout, scorer).totals()) == whole
    monkeypatch.setattr(module, "BLOCK_TOKENS", 7)
    monkeypatch.setattr(streamed, "IN_MEMORY", 5)
    cut = metrics(tally(rollout, scorer).totals())
    for name, value in whole.items():
        assert cut[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    for name in ("tokens", "abs_logp_max", "ratio_q01", "ratio_q50", "seq_ratio_max"):
        assert cut[name] == whole[name]


def test_first_argmax_divergence() -> None:
    assert first_argmax_divergence([[4, 7], [2, 9]]) == 2
    assert first_argmax_divergence([]) is None


def chain(sides: list[list[np.ndarray]]) -> ChainTally:
    found = ChainTally(2)
    for sequence in zip(*sides, strict=True):
        found.add(list(sequence))
    return found.finish()


def test_the_terms_add_up_to_the_total_exactly() -> None:
    rng = np.random.default_rng(0)
    sides = [[rng.uniform(-20, 0, 50).astype(np.float32).astype(float) for _ in range(3)]
             for _ in range(3)]  # fmt: skip
    found = chain(sides)
    assert found.exact and found.tokens == 150
    engine, cross, total = (found.summary(i, 1)["mean"] for i in (0, 1, -1))
    assert engine + cross == pytest.approx(total)


def test_log_probabilities_that_are_not_float32_add_up_within_the_tolerance() -> None:
    """Rounded (4 decimals) or float64 log-probabilities: the terms add up within the
    stated tolerance, not bit for bit, and the claims say so (no refusal, no traceback)."""
    rng = np.random.default_rng(2)
    sides = [[np.round(rng.uniform(-20, 0, 64), 4) for _ in range(2)] for _ in range(3)]
    found = chain(sides)
    assert not found.exact and found.tokens == 128


def test_paired_intervals_share_their_resamples() -> None:
    sums, tokens = np.array([3.0, 7.0]), np.array([2.0, 2.0])
    first = mean_interval(sums, tokens, 7)
    assert first == mean_interval(sums, tokens, 7)
    assert first is not None and first.low <= 2.5 <= first.high and first.method == "bootstrap"


def test_many_sequences_take_the_normal_interval(monkeypatch) -> None:
    rng = np.random.default_rng(4)
    tokens = rng.integers(10, 100, 1500).astype(float)
    sums = tokens * rng.normal(0.02, 0.01, tokens.size)
    bootstrap = mean_interval(sums, tokens, 3)
    monkeypatch.setattr(streamed, "BOOTSTRAP_SEQUENCES", 100)
    normal = mean_interval(sums, tokens, 3)
    assert bootstrap is not None and normal is not None and normal.method == "normal"
    assert normal.low == pytest.approx(bootstrap.low, rel=0.02)
    assert normal.high == pytest.approx(bootstrap.high, rel=0.02)


@pytest.mark.parametrize("in_memory", [1 << 22, 3])
def test_order_statistics_are_exact(in_memory: int) -> None:
    rng = np.random.default_rng(5)
    for n in (1, 2, 17, 5000):
        x = rng.normal(0, 0.05, n) * rng.choice([1, 1e-12, 1e6], n)
        x[::7] = 0.0
        spill = Spill(in_memory)
        for part in np.array_split(x, 3):
            spill.add(part)
        qs = [0.0, 0.01, 0.05, 0.5, 0.95, 0.99, 1.0]
        assert quantiles(spill, qs) == np.quantile(x, qs).tolist()
        capped = np.quantile(np.exp(np.minimum(x, 700)), qs).tolist()
        assert quantiles(spill, qs, lambda v: math.exp(min(v, 700))) == capped


def test_a_mismatch_at_the_least_log_probability_is_finite_and_positive() -> None:
    # issue 49's probe: a log p of -1e300 overflowed exp in the sequence metrics (a
    # warning on the terminal); one of -1.7e308 made k3 negative, so a k3 gate held
    rollout, scorer = [[LOGPROB_FLOOR] * 3, [-0.5]], [[-0.5] * 3, [LOGPROB_FLOOR]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = metrics(tally(rollout, scorer).totals())
    numbers = [v for v in found.values() if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in numbers)
    assert found["kl_k3"] > 1e100 and found["seq_ratio_max"] > 1e100
    assert found["ppl_rollout"] > 1e100 and found["seq_geo_ratio_max"] > 1e100


def test_a_growing_mismatch_raises_the_alarm() -> None:
    rising = trend([1, 2, 3, 4, 5], [1e-4, 2e-4, 2.5e-4, 4e-4, 9e-4])
    assert rising["alarm"] and rising["p_value"] == pytest.approx(1 / 120)
    assert rising["slope_per_step"] > 0
    assert not trend([1, 2, 3, 4, 5], [3e-4, 1e-4, 4e-4, 1e-4, 5e-4])["alarm"]
    assert not trend([1, 2, 3], [1e-4, 2e-4, 3e-4])["alarm"]  # three steps cannot reach 0.05
    assert not trend(list(range(8)), [0.0] * 8)["alarm"]  # bit-equal at every step


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
    with pytest.raises(KvreplayError, match="at least -3.403e[+]38"):
        Turn([1], [-1e300])  # past any float32: a forgery, and it would overflow the sums
    with pytest.raises(KvreplayError, match="2 values for 1 tokens"):
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


def test_the_claims_types_hold_every_key_the_tally_writes(tmp_path) -> None:
    """Logged rollouts with steps, environments, masks and logging modes: the tally's
    claims, typed and encoded again, are what it wrote (claims.json and --json are the
    encoding of the types)."""
    import json

    from kvreplay.experiments.rollout.claims import plain, typed
    from kvreplay.experiments.rollout.logged import read_logged
    from kvreplay.experiments.rollout.tally import measure

    rng = np.random.default_rng(0)
    lines = []
    for i in range(12):
        rollout = -rng.exponential(0.5, 6)
        lines.append({
            "id": f"r{i}", "prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6, 7, 8],
            "rollout_logprobs": rollout.tolist(),
            "trainer_logprobs": np.minimum(rollout + rng.normal(0, 0.01 * (i + 1), 6), 0).tolist(),
            "mask": [1, 1, 1, 1, 1, 0], "step": i // 3, "environment": "math" if i % 2 else "code",
            "rollout_logprobs_mode": "raw", "trainer_logprobs_mode": "raw",
        })  # fmt: skip
    path = tmp_path / "logged.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    measured = measure(read_logged(path), "trainer")
    written = {group: tally.claims() for group, tally in measured.groups.items()}
    (group,) = written.values()
    assert {"kept_tokens", "logprobs", "steps", "environments"} <= group.keys()
    typed_claims = typed(written)
    assert json.dumps(plain(typed_claims), sort_keys=True) == json.dumps(written, sort_keys=True)
    steps = typed_claims["logged"].steps["trainer"]
    assert [row.step for row in steps.by_step] == [0, 1, 2, 3] and steps.trend.steps == 4
