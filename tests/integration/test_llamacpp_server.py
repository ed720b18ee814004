"""The http backend against a real llama.cpp server (``llama-server``, built by ``make
setup-llamacpp``) on the embedded SmolLM2 GGUF, with the server's own defaults beside
four slots: the probe, matched rows whose hit read every computed token and whose miss
read none, companions on their own slots, audit against the server, a forged row caught,
and a server that went away; and a server that saves slots, whose hit replica continues
from the live state saved and restored."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from forgery import assert_named, audit, read_rows, rechain
from helpers import core, free_port, invoke, same_suffixes, wait_until_up

from kvreplay.model.embedded import EMBEDDED

pytestmark = pytest.mark.slow
SERVER = (
    Path(__file__).resolve().parents[2] / "build" / "llamacpp" / "cmake" / "bin" / "llama-server"
)


@contextmanager
def llama_server(folder: Path, *flags: str) -> Iterator[str]:
    """A llama-server on the embedded SmolLM2 GGUF on a free loopback port, stopped after."""
    if not SERVER.is_file():
        pytest.fail("llama-server is not built here; run `make setup-llamacpp`.")
    gguf = EMBEDDED["smollm2-135m"].part_paths()[0]
    port = free_port()
    with (folder / "server.log").open("w") as log:
        process = subprocess.Popen(
            [SERVER, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
             "--ctx-size", "4096", *flags],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, process, limit=120)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(tmp_path_factory.mktemp("llama-server"), "--parallel", "4") as url:
        yield url


@pytest.fixture(scope="module")
def matched(server: str, tmp_path_factory: pytest.TempPathFactory, smollm2_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("llama-http") / "matched"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
        result = invoke(
            "run", "matched", "--backend", "http", "--url", server, "--plan", "short",
            "--n", "3", "--dtypes", "fp16", "--companions", "0", "--out", out,
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_probe_names_the_server_and_what_it_offers(server: str) -> None:
    result = invoke("probe", "--url", server)
    assert result.exit_code == 0, result.output
    assert "llamacpp" in result.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
    assert "kvreplay can audit this server" in result.stdout
    assert re.search(r"restores a saved slot state +no\n", result.stdout)


def test_hit_reads_every_computed_token_and_miss_none(matched: Path) -> None:
    with (matched / "matched_live_prefill.csv").open(newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert len(lines) == 3
    for line in lines:
        assert line["integrity_pass"] == "true"
        assert int(line["live_cached_tokens"]) > 0
        assert int(line["live_cached_tokens"]) < int(line["prefix_token_count"])
        assert line["prefill_cached_tokens"] == "0"
    print("llama-server hit vs miss suffix_equal:", [line["suffix_equal"] for line in lines])


def test_companions_go_to_their_own_slots(server: str, tmp_path: Path, smollm2_cache: Path) -> None:
    """Concurrent companions are attempted, not controlled: the row records them."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
        out = tmp_path / "companions"
        result = invoke(
            "run", "matched", "--backend", "http", "--url", server, "--plan", "short",
            "--n", "2", "--dtypes", "fp16", "--companions", "1", "--out", out,
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    with (out / "matched_live_prefill.csv").open(newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert [len(json.loads(line["batch_companions"])) for line in lines] == [1, 1]
    assert all(line["batched_suffix_sha256"] for line in lines)


def test_audit_against_the_server_passes_and_catches_a_forgery(
    matched: Path, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path
) -> None:
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    result = audit(matched, "--url", server)
    assert result.exit_code == 0, result.output
    forged = tmp_path / "forged"
    forged.mkdir()
    for name in ("manifest.json", "items.jsonl", "rows.jsonl", "matched_live_prefill.csv"):
        (forged / name).write_bytes((matched / name).read_bytes())
    records = read_rows(forged)
    records[1]["data"]["arms"]["prefill"]["suffix_sha256"] = "0" * 64
    rechain(forged, records)
    assert_named(audit(forged, "--url", server), "prefill")


def test_a_server_that_went_away_is_named_in_one_sentence(
    matched: Path, monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path
) -> None:
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    gone = f"http://127.0.0.1:{free_port()}"
    result = invoke("audit", matched, "--url", gone)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert gone in result.stderr and result.stderr.strip().count("\n") == 0


def test_a_server_that_saves_slots_replicates_the_hit_from_its_restored_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path
) -> None:
    """With --slot-save-path the hit's replica is the live state saved, erased and loaded
    back into its slot: the row names that construction, and its gate holds it to the
    hit's suffix, first-step logprobs and cached tokens; audit re-executes it."""
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    slots = tmp_path / "slots"
    slots.mkdir()
    with llama_server(tmp_path, "--parallel", "1", "--slot-save-path", f"{slots}/") as url:
        probe = invoke("probe", "--url", url)
        assert re.search(r"restores a saved slot state +yes\n", probe.stdout), probe.output
        out = tmp_path / "restored"
        result = invoke(
            "run", "matched", "--backend", "http", "--url", url, "--plan", "short",
            "--n", "2", "--dtypes", "fp16", "--companions", "0", "--out", out,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert [p.name for p in slots.iterdir()] == ["kvreplay-slot0.bin"]
        assert audit(out, "--url", url).exit_code == 0
    records = [r for r in read_rows(out) if "arms" in r["data"]]
    assert len(records) == 2
    for record in records:
        arms = record["data"]["arms"]
        assert arms["left_replica"]["construction"] == "cache-hit-restored"
        assert arms["prefill_replica"]["construction"] == "cache-miss"
        assert (
            arms["left_replica"]["served"]["cached_tokens"]
            == (arms["left"]["served"]["cached_tokens"])
        )
        print("restored replica gate:", record["data"]["replicas"]["left"])


@pytest.mark.core
def test_the_core_install_runs_checks_and_audits_the_same_rows(
    server: str, matched: Path, smollm2_cache: Path, tmp_path: Path, monkeypatch
) -> None:
    """The core install (no torch; the model's package installed with its documented
    one-liner) runs the rows this environment ran against the same server, token for token
    and with the same model identity, audits them, and a check there holds."""
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    out = tmp_path / "core"
    made = core("run", "matched", "--backend", "http", "--url", server, "--plan", "short",
                "--n", "3", "--dtypes", "fp16", "--companions", "0", "--out", out)  # fmt: skip
    assert made.returncode == 0, made.stderr
    same_suffixes(out, matched)
    contracts = [json.loads((r / "manifest.json").read_text())["contract"] for r in (out, matched)]
    assert contracts[0]["model_info"] == contracts[1]["model_info"]
    assert "torch" not in contracts[0]["environment"]
    audited = core("audit", out, "--url", server)
    assert audited.returncode == 0 and "PASS" in audited.stdout, audited.stdout + audited.stderr
    verdict = tmp_path / "verdict.json"
    checked = core("check", "--backend", "http", "--url", server, "--plan", "short",
                   "--n", "2", "--dtypes", "fp16", "--companions", "0", "--expect",
                   "max-divergent", "--max-divergent", "2", "--out", tmp_path / "check",
                   "--json", verdict)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(verdict.read_text())["verdict"] == "holds"


@pytest.fixture(scope="module")
def evicting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second, small llama-server (starts in seconds): slots for the arm and two traffic
    clients, --metrics, and no host-memory prompt cache (--cache-ram 0), which would
    otherwise restore an evicted slot's state."""
    folder = tmp_path_factory.mktemp("llama-server-evicting")
    with llama_server(folder, "--parallel", "3", "--metrics", "--cache-ram", "0") as url:
        yield url


def test_history_under_traffic_names_what_an_evicted_hit_read(
    evicting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path
) -> None:
    """history end to end: the traffic arm ran beside two clients and the server's own
    count of busy requests; the unrelated prompts on the arm's slot evicted P, and the row
    says how many cached tokens the hit still read (none or part, never all); the warm
    prefill is read whole; the CSV, analysis, report and audit follow from the rows."""
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    out = tmp_path / "history"
    result = invoke(
        "run", "history", "--backend", "http", "--url", evicting, "--plan", "short",
        "--n", "2", "--dtypes", "fp16", "--companions", "0", "--traffic", "2", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with (out / "history_hit_miss.csv").open(newline="") as handle:
        lines = list(csv.DictReader(handle))
    rows = {r["data"]["item_id"]: r["data"] for r in read_rows(out)}
    assert len(lines) == 2
    for line in lines:
        arms = rows[line["row_id"]]["arms"]
        assert line["hit_read"] == "all" and line["miss_cached_tokens"] == "0"
        assert line["warm_read"] == "all"
        evicted = arms["evicted"]["served"]
        assert line["evicted_read"] in ("none", "part"), line
        assert int(line["evicted_cached_tokens"]) == evicted["cached_tokens"][0]
        assert int(line["evicted_cached_tokens"]) < int(line["evicted_expected_cached_tokens"])
        assert int(line["evicted_tokens"]) >= int(line["evicted_expected_cached_tokens"])
        load = arms["traffic"]["served"]["load"]
        assert line["traffic_clients"] == "2" and int(line["traffic_sent"]) == load["sent"] >= 1
        assert load["completed"] + load["failed"] == load["sent"]
        assert load["server_running_max"] is not None and load["polls"] >= 1
        assert line["integrity_pass"] == "true"
    print("history on llama-server:", [(x["evicted_read"], x["traffic_equal_hit"]) for x in lines])
    assert invoke("analyze", out).exit_code == 0
    assert invoke("report", out).exit_code == 0
    audited = invoke("audit", out, "--url", evicting, "--sample", 1)
    assert audited.exit_code == 0 and "PASS" in audited.output, audited.output


def test_a_check_under_traffic_compares_the_hit_with_the_hit_alone_and_the_miss(
    evicting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path
) -> None:
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    result = invoke(
        "check", "--backend", "http", "--url", evicting, "--plan", "short", "--n", "2",
        "--dtypes", "fp16", "--companions", "0", "--traffic", "2", "--expect", "max-divergent",
        "--max-divergent", "2", "--out", tmp_path / "check", "--json", tmp_path / "v.json",
        "--junit", tmp_path / "v.xml",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(
        r"under traffic the cache-hit continuation differs from the cache-hit alone on \d of "
        r"2 item\(s\) and from the cache-miss on \d",
        result.output,
    ), result.output
    assert (tmp_path / "check" / "history_hit_miss.csv").is_file()
    verdict = json.loads((tmp_path / "v.json").read_text())
    traffic = verdict["traffic"]
    assert verdict["schema"] == "kvreplay-check-v4" and traffic["items"] == 2
    assert set(traffic["suffix_differs_from"]) == {"cache-hit", "cache-miss"}
    assert traffic["load"]["in_flight_max"] >= 1  # the clients' own count of what they sent
    assert "traffic_suffix_differs_from_cache-hit" in (tmp_path / "v.xml").read_text()
