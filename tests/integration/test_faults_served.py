"""vLLM faults planted in a real ``vllm serve`` through kvreplay's vLLM general plugin
(issue 43), so the HTTP path is exercised end to end: the server is started with
``KVREPLAY_FAULT`` and the plugin folder on its path, and kvreplay, a client of it, knows
nothing of the fault. On a tiny Qwen2 in fp32 with a small K/V pool (64 blocks, so an
eviction is quick):

- the clean server (the plugin loaded, no fault named) holds under ``--traffic``;
- a write race between requests batched in one step is caught under ``--traffic``;
- a block evicted while its hash stays in the table is caught by the history experiment's
  ``evicted`` arm, whose hit then reads another prompt's K/V.

One server per case; start-up takes tens of seconds on a loaded 2-core box.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import invoke, vllm_server
from tiny import save_tiny

from kvreplay.faults.plugin import write_plugin_folder
from kvreplay.faults.registry import ENV

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("served-faults") / "model", "served_qwen2")


@contextmanager
def vllm_serve(model: Path, fault: str | None, folder: Path) -> Iterator[tuple[str, Path]]:
    """A ``vllm serve`` of ``model`` with ``fault`` planted; its address and log."""
    log = folder / "vllm.log"
    path = [str(write_plugin_folder(folder / "plugin")), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), ENV: fault}
    flags = ("--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--block-size", "32", "--max-model-len", "1024",
             "--num-gpu-blocks-override", "64")  # fmt: skip
    with vllm_server(model, log, *flags, env=env) as url:
        yield url, log


def check(url: str, model: Path, out: Path, *extra: object):
    return invoke("check", "--backend", "http", "--url", url, "--model", model, "--plan",
                  "short", "--dtypes", "fp32", "--n", 2, "--out", out, *extra)  # fmt: skip


def test_the_clean_server_holds_under_traffic(model: Path, tmp_path: Path) -> None:
    with vllm_serve(model, None, tmp_path) as (url, log):
        result = check(url, model, tmp_path / "run", "--traffic", 2)
    assert result.exit_code == 0, result.output
    assert "kvreplay: planted" not in log.read_text()


def test_a_write_race_between_batched_requests_is_caught_under_traffic(
    model: Path, tmp_path: Path
) -> None:
    with vllm_serve(model, "vllm-concurrent-race", tmp_path) as (url, log):
        alone = check(url, model, tmp_path / "alone")
        loaded = check(url, model, tmp_path / "loaded", "--traffic", 2)
    assert "kvreplay: planted the fault vllm-concurrent-race" in log.read_text()
    assert alone.exit_code == 0, alone.output  # no judged arm shares a step with another
    assert loaded.exit_code == 1, loaded.output
    assert "under traffic the cache-hit continuation" in loaded.output


def test_a_stale_hash_after_an_eviction_is_caught_by_the_evicted_arm(
    model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "history"
    with vllm_serve(model, "vllm-evict-stale-hash", tmp_path) as (url, _):
        result = invoke("run", "history", "--backend", "http", "--url", url, "--model", model,
                        "--plan", "short", "--dtypes", "fp32", "--n", 2, "--traffic", 1,
                        "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line)["data"] for line in (out / "rows.jsonl").read_text().splitlines()]
    for row in rows:
        arms = row["arms"]
        assert arms["hit"]["suffix_sha256"] == arms["miss"]["suffix_sha256"]
        evicted = arms["evicted"]["served"]
        # the table still names P's evicted blocks: the hit claims all of P, reads others' K/V
        assert evicted["cached_tokens"][0] == evicted["expected_cached_tokens"] > 0
    assert any(r["arms"]["evicted"]["suffix_sha256"] != r["arms"]["miss"]["suffix_sha256"]
               for r in rows)  # fmt: skip
