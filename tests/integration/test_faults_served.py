"""vLLM faults planted in a real ``vllm serve`` through kvreplay's vLLM general plugin
(issues 43, 50), so the HTTP path is exercised end to end: the server is started with
``KVREPLAY_FAULT`` and the plugin folder on its path, and kvreplay, a client of it, knows
nothing of the fault. On a tiny Qwen2 in fp32 with a 16-block K/V pool (as a check
starts its own engine, so that filling the pool takes one short prompt):

- the clean server (the plugin loaded, no fault named) passes the default check, the
  request-shape battery, every shape exercised through the server's cache reset and
  ``/metrics``, and the check under ``--traffic``;
- the default check catches, at the first item, a write race between requests batched
  in one step (and so does ``--traffic``), a block evicted while its hash stays in the
  table (and so does the history experiment's ``evicted`` arm), and a ``cache_salt``
  dropped from the block hash (through the server's own ``cache_salt`` field).

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

from kvreplay.experiments.battery.shapes import SHAPES
from kvreplay.faults.plugin import write_plugin_folder
from kvreplay.faults.registry import ENV

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

POOL = 16


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
             "--block-size", "32", "--max-model-len", str((POOL - 1) * 32),
             "--num-gpu-blocks-override", str(POOL))  # fmt: skip
    with vllm_server(model, log, *flags, env=env) as url:
        yield url, log


def check(url: str, model: Path, folder: Path, *extra: object):
    folder.mkdir(parents=True, exist_ok=True)  # --json's folder exists before the check
    return invoke("check", "--backend", "http", "--url", url, "--model", model, "--plan",
                  "short", "--out", folder / "run", "--json", folder / "verdict.json",
                  *extra)  # fmt: skip


def test_the_clean_server_passes_every_shape_and_the_check_under_traffic(
    model: Path, tmp_path: Path
) -> None:
    with vllm_serve(model, None, tmp_path) as (url, log):
        battery = check(url, model, tmp_path / "battery")
        loaded = check(url, model, tmp_path / "loaded", "--traffic", 2)
    assert "kvreplay: planted" not in log.read_text()
    assert battery.exit_code == 0, battery.output
    verdict = json.loads((tmp_path / "battery" / "verdict.json").read_text())
    assert verdict["shapes"]["ran"] == list(SHAPES)  # fp32, the server's own precision
    assert "bit for bit at the reported log-probabilities" in verdict["sentence"]
    assert loaded.exit_code == 0, loaded.output


def caught(folder: Path, fault: str, shape: str) -> None:
    verdict = json.loads((folder / "verdict.json").read_text())
    assert verdict["exit_code"] == 1 and verdict["planted_fault"] is None  # the server's
    assert len(verdict["items"]) == 1 and shape in verdict["items"][0]["detected"], fault


def test_a_write_race_between_batched_requests_is_caught(model: Path, tmp_path: Path) -> None:
    with vllm_serve(model, "vllm-concurrent-race", tmp_path) as (url, log):
        battery = check(url, model, tmp_path / "battery")
        loaded = check(url, model, tmp_path / "loaded", "--traffic", 2)
    assert "kvreplay: planted the fault vllm-concurrent-race" in log.read_text()
    assert battery.exit_code == 1, battery.output
    caught(tmp_path / "battery", "vllm-concurrent-race", "twin")
    assert loaded.exit_code == 1, loaded.output
    assert "under traffic the cache-hit continuation" in loaded.output


def test_a_stale_hash_after_an_eviction_is_caught(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "history"
    with vllm_serve(model, "vllm-evict-stale-hash", tmp_path) as (url, _):
        battery = check(url, model, tmp_path / "battery")
        history = invoke("run", "history", "--backend", "http", "--url", url, "--model", model,
                         "--plan", "short", "--dtypes", "fp32", "--n", 2, "--traffic", 1,
                         "--out", out)  # fmt: skip
    assert battery.exit_code == 1, battery.output
    caught(tmp_path / "battery", "vllm-evict-stale-hash", "evicted")
    assert history.exit_code == 0, history.output
    rows = [json.loads(line)["data"] for line in (out / "rows.jsonl").read_text().splitlines()]
    for row in rows:
        arms = row["arms"]
        assert arms["hit"]["suffix_sha256"] == arms["miss"]["suffix_sha256"]
        evicted = arms["evicted"]["served"]
        # the table still names P's evicted blocks: the hit claims all of P, reads others' K/V
        assert evicted["cached_tokens"][0] == evicted["expected_cached_tokens"] > 0
    assert any(r["arms"]["evicted"]["suffix_sha256"] != r["arms"]["miss"]["suffix_sha256"]
               for r in rows)  # fmt: skip


def test_a_salt_dropped_from_the_block_hash_is_caught(model: Path, tmp_path: Path) -> None:
    with vllm_serve(model, "vllm-hash-drops-salt", tmp_path) as (url, _):
        battery = check(url, model, tmp_path / "battery")
    assert battery.exit_code == 1, battery.output
    caught(tmp_path / "battery", "vllm-hash-drops-salt", "salted")
    assert "its hit read" in battery.output and "where 0 were written" in battery.output
