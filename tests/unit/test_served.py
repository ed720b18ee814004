"""Served rows without an engine (issue 13): the cache-condition gate, the expected hit,
the logprob and margin measures, and the backend registry: settings that only the
backend declaring them takes."""

from __future__ import annotations

import pytest

from kvreplay.backends import backend_from_contract, make_backend, registry, setting_options
from kvreplay.contract.upgrade import current_run
from kvreplay.core.errors import KvreplayError
from kvreplay.core.trajectory import Prefix
from kvreplay.experiments.matrix.table import first_token_logprob_diff
from kvreplay.harness.requests import computed_tokens
from kvreplay.harness.rows import ArmResult, ReplicaGate, ServedReport
from kvreplay.model.decode import Segment, Trajectory


def arm(cached: int, expected: int | None, first: list[list] | None = None) -> ArmResult:
    suffix = Trajectory([Segment("trace", [], [5, 6, 7], "cap", [0.5, 0.25, 0.125])])
    return ArmResult(
        "cache-hit", None, "f" * 64, 5, suffix, "a" * 64, 10,
        served=ServedReport([cached], first or [[5, -0.1], [9, -2.0]], expected, True),
    )  # fmt: skip


def generated(prompt: int, stage: int, opener: int = 0) -> Prefix:
    """A prefix of ``prompt`` tokens, one stage of ``stage`` tokens and the next opener."""
    segment = Segment("think", [], list(range(stage)), "cap")
    return Prefix(list(range(prompt + stage + opener)), prompt, [segment])


def test_expected_hit_counts_the_full_blocks_the_rewrite_computed() -> None:
    vllm = make_backend("vllm", block_size=32)
    assert computed_tokens(generated(60, 36)) == 95
    assert vllm.expected_hit(computed_tokens(generated(60, 36))) == 64  # two full blocks
    assert vllm.expected_hit(computed_tokens(generated(60, 37))) == 96
    assert computed_tokens(generated(60, 36, opener=4)) == 95  # the opener is not computed


@pytest.mark.parametrize(("cached", "met"), [(64, True), (32, False), (0, False)])
def test_a_hit_that_did_not_hit_fails_its_gate(cached: int, met: bool) -> None:
    gate = ReplicaGate.served([arm(cached, 64)], [arm(cached, 64)])
    assert gate.cached_tokens_equal and gate.suffix_exact and gate.logits_exact
    assert gate.cache_condition_met is met and gate.passed is met


def test_replica_with_other_cached_tokens_fails() -> None:
    gate = ReplicaGate.served([arm(64, 64)], [arm(32, 64)])
    assert not gate.cached_tokens_equal and not gate.passed


def test_first_token_logprob_diff_needs_the_token_in_both_lists() -> None:
    left = arm(64, 64, [[5, -0.1], [9, -2.0]])
    assert first_token_logprob_diff(left, arm(0, 0, [[5, -0.35], [9, -1.0]])) == pytest.approx(0.25)
    assert first_token_logprob_diff(left, arm(0, 0, [[9, -0.2], [4, -1.0]])) is None


def test_margin_at_a_suffix_index() -> None:
    result = arm(64, 64)
    assert result.margin_at(1) == 0.25 and result.margin_at(None) is None
    assert result.margin_at(3) is None


def test_served_report_round_trips() -> None:
    report = ServedReport([64, 96], [[5, -0.1]], 64, True, ["r1"])
    assert ServedReport.from_dict(report.to_dict()) == report
    assert "companions" not in ServedReport([0], [], 0).to_dict()


def test_a_setting_is_taken_only_by_the_backend_that_declares_it() -> None:
    with pytest.raises(KvreplayError, match="--block-size does not apply to the hf backend"):
        make_backend("hf", block_size=48)
    with pytest.raises(KvreplayError, match="multiple of 32"):
        make_backend("vllm", block_size=48)
    with pytest.raises(KvreplayError, match="--block-size must be an integer"):
        make_backend("vllm", block_size=32.0)
    with pytest.raises(KvreplayError, match="Unknown backend 'tgi'"):
        make_backend("tgi")
    assert make_backend().contract() == {
        "name": "hf",
        "attn_implementation": "sdpa",
        "trust_remote_code": False,
    }
    assert make_backend("vllm").contract()["kv_access"] is True
    assert setting_options()["block_size"].backends == ("vllm",)
    assert {"hf", "vllm"} <= set(registry())


def test_a_recorded_contract_is_read_back_through_one_upgrade_step() -> None:
    """The committed runs' contracts (an hf run named no backend; every run held the
    attention and remote-code settings beside the model) read as today's layout, and
    the backend they name rebuilds its entry field for field."""
    recorded = {
        "block_size": 32, "companions": 3, "enable_prefix_caching": True,
        "enforce_eager": True, "kv_access": False, "max_model_len": 8192,
        "max_num_batched_tokens": 8192, "max_num_seqs": 8, "name": "vllm", "seed": 0,
    }  # fmt: skip
    old = {"backend": recorded, "attn_implementation": "sdpa", "trust_remote_code": False}
    upgraded = current_run(old)["backend"]
    assert upgraded == {**recorded, "trust_remote_code": False}
    assert backend_from_contract(upgraded).contract() == upgraded
    hf = current_run({"model": "m", "attn_implementation": "eager", "trust_remote_code": False})
    assert hf == {
        "model": "m",
        "backend": {"name": "hf", "attn_implementation": "eager", "trust_remote_code": False},
    }
    assert current_run(hf) is hf  # today's layout reads as it is
    now = make_backend("vllm").contract()
    assert now == {**upgraded, "kv_access": True}
    assert backend_from_contract(now).contract() == now


def test_vllm_serves_hit_and_miss_and_reads_blocks_for_the_kv_experiments() -> None:
    """matched and resample stay served panels on vLLM; the K/V experiments run on its
    blocks, except on an engine recorded without K/V access (the runs before it)."""
    from kvreplay.experiments import get_experiment

    vllm = make_backend("vllm")
    assert get_experiment("matched", vllm, require_engine=False).served
    assert get_experiment("resample", vllm, require_engine=False).served
    for name in ("transplant", "localize", "bridge", "fixed-prefix"):
        assert not get_experiment(name, vllm, require_engine=False).served
    before = backend_from_contract({**vllm.contract(), "kv_access": False})
    assert not before.kv_access and get_experiment("matched", before, require_engine=False).served
    with pytest.raises(KvreplayError, match="K/V tensors, which the vllm backend does not"):
        get_experiment("transplant", before, require_engine=False)
