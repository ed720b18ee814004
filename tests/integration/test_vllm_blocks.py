"""Block K/V on the vllm backend (issue 37), on the tiny served Qwen2 in fp32 (bit-exact
on every CPU, so nothing here rests on one kernel family's bf16 rounding): the K/V
experiments run on the engine's cached blocks end to end through the CLI and audit; a
transplant of a replica changes nothing; a transplant of other K/V changes the
continuation, and the hit guard sees which blocks a request read; blocks a reset evicted
are refused in one sentence. It runs in the vLLM environment (``make test-vllm``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers import invoke
from tiny import save_tiny

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvreplay.backends.vllm.blocks import LAYOUTS  # noqa: E402
from kvreplay.contract.config import RunConfig  # noqa: E402
from kvreplay.core.errors import KvreplayError  # noqa: E402
from kvreplay.engines.worker import Worker  # noqa: E402
from kvreplay.experiments.localize.experiment import _decide  # noqa: E402
from kvreplay.harness.blocks import build_state, continue_state  # noqa: E402
from kvreplay.harness.units import Clock  # noqa: E402
from kvreplay.model.construct import Prefix  # noqa: E402
from kvreplay.model.decode import Sampler  # noqa: E402
from kvreplay.model.state import bit_equal, make_replica, transplant  # noqa: E402

TRANSPLANT_CSV = "kv_transplant_later.csv"


def rows(run: Path) -> list[dict]:
    return [json.loads(line)["data"] for line in (run / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def blocks_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transplant (a blind panel of 2) and bridge (2 items) on the engine's blocks."""
    root = tmp_path_factory.mktemp("vllm-blocks")
    model = save_tiny(root / "model", "served_qwen2")
    out = root / "run"
    common = ("--model", model, "--plan", "short", "--dtypes", "fp32", "--backend", "vllm")
    result = invoke("run", "transplant", *common, "--panel", "blind", "--n", 2, "--out", out)
    assert result.exit_code == 0, result.output
    result = invoke("run", "bridge", *common, "--n", 2, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def engine_model(blocks_run: Path):
    """The run's engine, as a worker loads it for a K/V experiment."""
    manifest = json.loads((blocks_run / "manifest.json").read_text())
    config = RunConfig.from_contract(manifest["contract"]["run"], str(blocks_run))
    return config, Worker(config).model("fp32")


def prefixes(run: Path) -> list[Prefix]:
    return [
        Prefix(row["prefix_token_ids"], row["prompt_token_count"])
        for row in rows(run)
        if row.get("kind") == "prefix"
    ]


def test_transplant_rows_compare_and_move_the_cached_blocks(blocks_run: Path) -> None:
    manifest = json.loads((blocks_run / "manifest.json").read_text())
    assert manifest["contract"]["run"]["backend"]["kv_access"] is True
    panel = [row for row in rows(blocks_run) if row.get("kind") == "transplant"]
    assert len(panel) == 2
    for row in panel:
        covered = (row["prefix_token_count"] - 1) // 32 * 32  # P's full blocks, as cached
        assert row["block_kv"] == {"block_size": 32, "cached_tokens": covered,
                                   "tail_tokens": row["prefix_token_count"] - covered}  # fmt: skip
        assert len(row["comparison"]["per_layer"]) == 3 and row["all_layers_transplanted"]
        for name, arm in row["arms"].items():
            assert len(arm["cache_fingerprint"]) == 64, name
            served = arm["served"]  # every arm continued as a hit on its own blocks
            assert served["cached_tokens"][0] == served["expected_cached_tokens"] == covered
            assert served["blocks_read"] is True
        assert all(all(gate.values()) for gate in row["replicas"].values())
    with (blocks_run / TRANSPLANT_CSV).open() as handle:
        lines = list(csv.DictReader(handle))
    assert [line["integrity_pass"] for line in lines] == ["true", "true"]
    assert all(line["incremental_cache_into_prefill_recovers_donor"] == "true" for line in lines)


def test_bridge_live_blocks_equal_the_teacher_forced_rebuild(blocks_run: Path) -> None:
    """The blocks a generation wrote, prompt prefill and decode steps, equal the blocks
    of its tokens forced through the decode path, bit for bit, and continue alike."""
    bridge = [row for row in rows(blocks_run) if row.get("kind") is None]
    assert len(bridge) == 2
    for row in bridge:
        assert row["arms"]["live"]["construction"] == "live"
        assert row["arms"]["teacher"]["construction"] == "replay"
        assert row["comparison"]["cache"]["exact"] and row["comparison"]["logits"]["exact"]
        assert row["arms"]["live"]["suffix_sha256"] == row["arms"]["teacher"]["suffix_sha256"]
        assert row["boundary_cache_sequence_len"] == row["block_kv"]["cached_tokens"] > 0
    with (blocks_run / "live_teacher_bridge.csv").open() as handle:
        lines = list(csv.DictReader(handle))
    # the cache a hit continues from: the blocks and the tail it recomputes, so all of P
    assert all(x["boundary_cache_sequence_len"] == x["new_prefix_token_count"] for x in lines)
    result = invoke("analyze", blocks_run)
    assert result.exit_code == 0, result.output
    assert "2/2 caches exact in all layers" in result.output


def test_audit_reexecutes_the_block_rows(blocks_run: Path) -> None:
    result = invoke("audit", blocks_run)
    assert result.exit_code == 0, result.output


def test_a_transplant_of_a_replica_changes_nothing(engine_model) -> None:
    config, lm = engine_model
    state = build_state(lm, prefixes(config_dir(config))[0], "prefill")
    replica, check = make_replica(state)
    assert check.passed
    moved = transplant(replica, state)
    assert moved.cache_fingerprint() == state.cache_fingerprint()
    assert bit_equal(moved.logits, state.logits)
    own, own_report = continue_state(lm, state.copy(), config.plan, Sampler())
    after, report = continue_state(lm, moved, config.plan, Sampler())
    assert after.token_ids == own.token_ids
    assert report.blocks_read and report.condition_met and own_report.condition_met


def test_a_transplant_of_other_kv_changes_the_continuation(engine_model) -> None:
    """The donor holds the blocks of another P of the same length; the recipient then
    continues otherwise, and a transplant of one layer's V moves only that tensor."""
    config, lm = engine_model
    prefix = prefixes(config_dir(config))[0]
    other = Prefix([(t + 7) % 256 for t in prefix.token_ids], prefix.prompt_len)
    state = build_state(lm, prefix, "prefill")
    donor = build_state(lm, other, "prefill")
    donor.token_ids = list(state.token_ids)  # another P's K/V, offered for this P
    moved = transplant(donor, state)
    assert not bit_equal(moved.logits, state.logits)
    own, _ = continue_state(lm, state.copy(), config.plan, Sampler())
    after, report = continue_state(lm, moved, config.plan, Sampler())
    assert after.token_ids != own.token_ids and report.blocks_read
    one = transplant(donor, state, layers=[1], component="v")
    changed = [
        [not bit_equal(a, b) for a, b in zip(mine, theirs, strict=True)]
        for mine, theirs in zip(one.layer_tensors(), state.layer_tensors(), strict=True)
    ]
    assert changed == [[False, False], [False, True], [False, False]]
    reference = own
    assert _decide(lm, config.plan, Sampler(), Clock(), state.copy(), state.copy(), reference,
                   (0, 1, 2), "kv") is None  # fmt: skip
    assert _decide(lm, config.plan, Sampler(), Clock(), donor, state.copy(), reference,
                   (0, 1, 2), "kv") is not None  # fmt: skip


def test_the_hit_guard_sees_blocks_it_did_not_write(engine_model) -> None:
    config, lm = engine_model
    prefix = prefixes(config_dir(config))[0]
    state = build_state(lm, prefix, "prefill")
    other = state.copy()
    other.cache = [(keys + 1, values) for keys, values in other.cache]
    blocks = lm.engine.install(state)
    assert lm.engine.holds(state, blocks)
    lm.engine.install(other)
    assert not lm.engine.holds(state, blocks)


def test_reading_blocks_a_reset_evicted_is_refused_in_one_sentence(engine_model) -> None:
    config, lm = engine_model
    prefix = prefixes(config_dir(config))[0]
    state = build_state(lm, prefix, "prefill")
    lm.engine.reset()
    with pytest.raises(KvreplayError) as refused:
        lm.engine.read(prefix.token_ids, state.covered, "prefill")
    message = str(refused.value)
    assert "a prefix-cache reset or eviction dropped the rest" in message
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message


def random_blocks(count: int = 2, heads: int = 2, size: int = 32, dim: int = 64):
    """Seeded bf16 K and V as ``[tokens, kv_heads, head_dim]`` (the kernels' input) and
    in the cache layout ``[1, kv_heads, tokens, head_dim]``."""
    generator = torch.Generator().manual_seed(1)
    keys, values = (
        torch.randn(count * size, heads, dim, generator=generator).to(torch.bfloat16)
        for _ in range(2)
    )
    return (keys, values), [t.permute(1, 0, 2).unsqueeze(0) for t in (keys, values)]


def kernel_writes(kernel: str, keys: torch.Tensor, values: torch.Tensor, size: int = 32):
    """Two blocks as vLLM's own cache writer for ``kernel`` lays K and V out."""
    from vllm import _custom_ops as ops

    heads, dim = keys.shape[1], keys.shape[2]
    count = keys.shape[0] // size
    blocks = torch.zeros(count, heads, size, 2 * dim, dtype=keys.dtype)
    key_cache, value_cache = blocks.view(count, heads, size * 2, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, torch.arange(count * size), kernel
    )
    return blocks


def amx_writes(keys: torch.Tensor, values: torch.Tensor, size: int = 32) -> torch.Tensor:
    """vLLM's amx ``reshape_and_cache`` (csrc/cpu/cpu_attn_amx.hpp) transcribed element by
    element for bf16: the keys as 32-bit words (channel pairs) in groups of 16 tokens, the
    values as token pairs in groups of 16 channels."""
    tokens, heads, dim = keys.shape
    out = torch.zeros(tokens // size, heads, 2, size * dim, dtype=keys.dtype)
    for token in range(tokens):
        block, offset = divmod(token, size)
        group, in_group = divmod(offset, 16)
        pair, in_pair = divmod(offset, 2)
        for head in range(heads):
            for word in range(dim // 2):
                at = (group * 16 * (dim // 2) + word * 16 + in_group) * 2
                out[block, head, 0, at : at + 2] = keys[token, head, 2 * word : 2 * word + 2]
            for channel in range(dim):
                channels, lane = divmod(channel, 16)
                at = channels * size * 16 + pair * 32 + lane * 2 + in_pair
                out[block, head, 1, at] = values[token, head, channel]
    return out.reshape(tokens // size, heads, size, 2 * dim)


@pytest.mark.parametrize("kernel", sorted(LAYOUTS))
def test_every_block_layout_round_trips(kernel: str) -> None:
    raw = torch.randn(3, 2, 32, 64).to(torch.bfloat16)
    keys, values = LAYOUTS[kernel].unpack(raw)
    assert keys.shape == values.shape == (1, 2, 96, 32)
    assert bit_equal(LAYOUTS[kernel].pack(keys, values, 32), raw)


@pytest.mark.parametrize("kernel", ["vec", "vec16"])
def test_the_vec_layouts_are_what_the_kernels_write_on_this_cpu(kernel: str) -> None:
    (keys, values), cache = random_blocks()
    written = kernel_writes(kernel, keys, values)
    assert bit_equal(LAYOUTS[kernel].pack(*cache, 32), written)
    assert all(bit_equal(a, b) for a, b in zip(LAYOUTS[kernel].unpack(written), cache, strict=True))
    # the key of token 33 (block 1, offset 1), head 1, is stored channel-major
    assert bit_equal(written[1, 1].reshape(2, 32 * 64)[0].reshape(64, 32)[:, 1], keys[33, 1])


def test_the_amx_layout_is_what_vllms_amx_writer_does() -> None:
    """The CPU here may have no AMX (then vLLM's extension has no amx writer to run):
    the layout is checked against the writer's transcription, and on a CPU with AMX
    against the writer itself; an engine checks it again before it reads a block."""
    (keys, values), cache = random_blocks()
    written = amx_writes(keys, values)
    assert bit_equal(LAYOUTS["amx"].pack(*cache, 32), written)
    assert all(bit_equal(a, b) for a, b in zip(LAYOUTS["amx"].unpack(written), cache, strict=True))
    assert not bit_equal(LAYOUTS["vec"].pack(*cache, 32), written)
    if torch.cpu._is_amx_tile_supported():
        assert bit_equal(kernel_writes("amx", keys, values), written)


def test_an_engine_whose_kernel_kvreplay_misreads_is_refused(engine_model) -> None:
    _, lm = engine_model
    kept = lm.engine.layout
    wrong = "amx" if kept.name != "amx" else "vec"
    lm.engine.layout = LAYOUTS[wrong]
    try:
        with pytest.raises(KvreplayError, match="lays out its KV blocks otherwise"):
            lm.engine.check_layout()
    finally:
        lm.engine.layout = kept
    lm.engine.check_layout()


def config_dir(config: RunConfig) -> Path:
    return Path(config.run_dir)
