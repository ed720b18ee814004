"""The http backend (issue 26) against a real ``vllm serve`` on a tiny Qwen2 that vLLM's
CPU attention serves: probe, matched and resample rows with hit and miss arms, cached
tokens, integrity gates, analyze, report, audit against the server (and a forged row
caught), ``kvreplay check``. Error paths go through a small proxy in front of the real
server (a 500 mid-run, another model on resume, a slow answer) or a server that is not
OpenAI-compatible; no fake stands in for the server in an end-to-end test.

One server per test session (start-up takes minutes on a loaded 2-core box), on
loopback and a free port, stopped at the end. It runs in the vLLM environment.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from forgery import read_rows, rechain
from helpers import core, free_port, invoke, same_suffixes, vllm_server
from tiny import save_tiny

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(url, model folder) of a real vLLM server in dev mode, reporting cached tokens."""
    model = save_tiny(tmp_path_factory.mktemp("served") / "model", "served_qwen2")
    log = tmp_path_factory.mktemp("server-log") / "vllm.log"
    flags = ("--dtype", "bfloat16", "--enable-prompt-tokens-details", "--max-model-len", "1024",
             "--block-size", "32")  # fmt: skip
    with vllm_server(model, log, *flags) as url:
        yield url, model


class Proxy:
    """A loopback proxy to the real server that can fail the Nth completion with a 500,
    report another version (an upgraded server), or answer slowly: the error paths a
    server can take."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.fail_at, self.version, self.delay = upstream, None, None, 0.0
        self.completions = 0
        self.tamper: Callable[[dict], None] | None = None  # rewrites completions from fail_at
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.forward(None)

            def do_POST(self) -> None:
                self.forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def forward(self, body: bytes | None) -> None:
                time.sleep(proxy.delay)
                late = False
                if self.path.startswith("/v1/completions"):
                    proxy.completions += 1
                    late = proxy.fail_at is not None and proxy.completions >= proxy.fail_at
                    if late and proxy.tamper is None:
                        return self.answer(500, b'{"error": "injected"}')
                request = urllib.request.Request(
                    proxy.upstream + self.path, data=body, method=self.command,
                    headers={"Content-Type": "application/json"},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        status, data = response.status, response.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                if proxy.version and self.path.startswith("/version"):
                    data = json.dumps({"version": proxy.version}).encode()
                if self.path.startswith("/v1/completions") and late and proxy.tamper:
                    answer = json.loads(data)
                    proxy.tamper(answer)
                    data = json.dumps(answer).encode()
                self.answer(status, data)

            def answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxy(server: tuple[str, Path]) -> Iterator[Proxy]:
    front = Proxy(server[0])
    yield front
    front.close()


def run(url: str, model: Path, out: Path, experiment: str = "matched", *extra: object):
    return invoke("run", experiment, "--backend", "http", "--url", url, "--model", model,
                  "--n", 3, "--plan", "short", "--dtypes", "bf16", "--out", out,
                  *extra)  # fmt: skip


@pytest.fixture(scope="module")
def http_run(server: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    url, model = server
    out = tmp_path_factory.mktemp("http") / "run"
    result = run(url, model, out)
    assert result.exit_code == 0, result.output
    return out


def rows(folder: Path) -> list[dict]:
    return [json.loads(line)["data"] for line in (folder / "rows.jsonl").read_text().splitlines()]


def test_probe_says_the_server_can_be_audited(server: tuple[str, Path]) -> None:
    result = invoke("probe", "--url", server[0])
    assert result.exit_code == 0, result.output
    assert "resets its prefix cache        yes" in result.output
    assert "reports cached prompt tokens   yes" in result.output
    assert "kvreplay can audit this server" in result.output


def test_matched_rows_hold_a_verified_hit_and_a_miss(http_run: Path) -> None:
    data = rows(http_run)
    assert len(data) == 3
    for row in data:
        arms = row["arms"]
        hit, miss = arms["left"]["served"], arms["prefill"]["served"]
        assert hit["cached_tokens"][0] == (row["prefix_token_count"] - 1) // 32 * 32 > 0
        assert hit["expected_cached_tokens"] == hit["cached_tokens"][0]
        assert miss["cached_tokens"][0] == 0
        assert all(all(gate.values()) for gate in row["replicas"].values())
    contract = json.loads((http_run / "manifest.json").read_text())["contract"]
    backend = contract["run"]["backend"]
    assert backend["name"] == "http" and backend["identity"]["settings"]["block_size"] == 32
    assert "url" not in json.dumps(backend)  # the address is not part of the contract


def test_history_records_the_load_vllm_reports_and_what_each_hit_read(server, tmp_path) -> None:
    """history on vllm serve: the traffic arm ran beside two clients, with the running
    requests and cache usage vLLM's /metrics reported; the warm prefill is read whole;
    the evicted hit read at most what was written, the row says how much (this server's
    pool is larger than the bounded eviction fills, so part or all of P may survive)."""
    url, model = server
    out = tmp_path / "history"
    result = run(url, model, out, "history", "--n", 2, "--traffic", 2)
    assert result.exit_code == 0, result.output
    for row in rows(out):
        arms = {name: arm["served"] for name, arm in row["arms"].items()}
        load = arms["traffic"]["load"]
        assert load["clients"] == 2 and load["sent"] >= 1 and load["polls"] >= 1
        assert load["server_running_max"] is not None and load["kv_cache_usage_max"] is not None
        for name in ("hit", "traffic", "warm"):
            assert arms[name]["cached_tokens"][0] == arms[name]["expected_cached_tokens"] > 0
        evicted = arms["evicted"]
        assert 0 <= evicted["cached_tokens"][0] <= evicted["expected_cached_tokens"]
        assert evicted["evicted_tokens"] > 0
    assert invoke("analyze", out).exit_code == 0


def test_analyze_report_and_audit_against_the_server(http_run: Path, server, tmp_path) -> None:
    assert invoke("analyze", http_run).exit_code == 0
    assert invoke("report", http_run).exit_code == 0
    audited = invoke("audit", http_run, "--url", server[0], "--sample", 1)
    assert audited.exit_code == 0, audited.output
    refused = invoke("audit", http_run, "--sample", 1)
    assert refused.exit_code == 2 and "give --url URL" in refused.output


def test_a_forged_row_is_caught(http_run: Path, server, tmp_path: Path) -> None:
    import shutil

    forged = tmp_path / "forged"
    shutil.copytree(http_run, forged)
    for name in ("claims.json", "report.md", "report.html"):
        (forged / name).unlink(missing_ok=True)
    shutil.rmtree(forged / "figures", ignore_errors=True)
    data = read_rows(forged)
    data[0]["data"]["arms"]["left"]["served"]["cached_tokens"][0] += 32
    rechain(forged, data)
    result = invoke("audit", forged, "--url", server[0], "--sample", 3)
    assert result.exit_code == 1
    assert "cached_tokens" in result.output


def test_resample_and_check_over_http(server: tuple[str, Path], tmp_path: Path) -> None:
    url, model = server
    sampled = run(url, model, tmp_path / "resample", "resample", "--samples", 2)
    assert sampled.exit_code == 0, sampled.output
    assert "bf16:" in sampled.output  # the run ends with its verdict sentence
    checked = invoke("check", "--backend", "http", "--url", url, "--model", model, "--n", 1,
                     "--plan", "short", "--out", tmp_path / "check",
                     "--json", tmp_path / "v.json")  # fmt: skip
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["compared"] == ["cache-hit", "cache-miss"]
    assert checked.exit_code == verdict["exit_code"], checked.output


@pytest.mark.core
def test_the_core_install_runs_audits_and_checks_against_the_server(
    server: tuple[str, Path], http_run: Path, tmp_path: Path
) -> None:
    """The core install (no torch, no transformers: the model folder's tokenizer.json
    through tokenizers) runs the rows this environment ran against the same server, token
    for token, audits them against the server, and derives and reports them; a check
    there judges them."""
    url, model = server
    out = tmp_path / "core"
    made = core("run", "matched", "--backend", "http", "--url", url, "--model", model,
                "--n", 3, "--plan", "short", "--dtypes", "bf16", "--out", out)  # fmt: skip
    assert made.returncode == 0, made.stderr
    same_suffixes(out, http_run)
    audited = core("audit", out, "--url", url)
    assert audited.returncode == 0 and "PASS" in audited.stdout, audited.stdout + audited.stderr
    for command in ("analyze", "report"):
        assert core(command, out).returncode == 0
    verdict = tmp_path / "v.json"
    checked = core("check", "--backend", "http", "--url", url, "--model", model, "--n", 1,
                   "--plan", "short", "--out", tmp_path / "check", "--json", verdict)  # fmt: skip
    assert checked.returncode == json.loads(verdict.read_text())["exit_code"] in (0, 1)


def test_a_500_mid_run_loses_no_row_and_a_rerun_resumes(server, proxy: Proxy, tmp_path) -> None:
    url, model = server
    counted = run(proxy.url, model, tmp_path / "counted")
    assert counted.exit_code == 0, counted.output
    total, proxy.completions = proxy.completions, 0
    out = tmp_path / "run"
    proxy.fail_at = total * 6 // 10  # the same three rows: the 500 comes after the first
    failed = run(proxy.url, model, out)
    assert failed.exit_code == 2, failed.output
    assert "HTTP 500" in failed.output and "Traceback" not in failed.output
    kept = rows(out)
    assert 1 <= len(kept) < 3
    resumed = run(url, model, out)
    assert resumed.exit_code == 0, resumed.output
    assert rows(out)[: len(kept)] == kept and len(rows(out)) == 3


def _five_more_tokens(answer: dict) -> None:
    choice = answer["choices"][0]
    if not choice.get("logprobs"):  # the probe's own completion asks for none
        return
    choice["token_ids"] += choice["token_ids"][-1:] * 5
    choice["logprobs"]["top_logprobs"] += choice["logprobs"]["top_logprobs"][-1:] * 5


def test_a_completion_past_its_cap_is_refused_and_rows_kept(server, proxy: Proxy, tmp_path):
    """Issue 34: the real server's answers, five tokens more than asked from the second
    row on: one sentence, exit 2, the first row kept; an audit through it fails so too."""
    url, model = server
    alone = ("--companions", 0)  # a row's requests then do not depend on the other items
    counted = run(proxy.url, model, tmp_path / "one", "matched", "--n", 1, *alone)
    assert counted.exit_code == 0, counted.output
    first, proxy.completions = proxy.completions, 0
    proxy.fail_at, proxy.tamper = first + 1, _five_more_tokens
    out = tmp_path / "run"
    refused = run(proxy.url, model, out, "matched", *alone)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert refused.stderr.splitlines()[-1].endswith("whose cap is 6.")
    assert [row["item_id"] for row in rows(out)] == [rows(tmp_path / "one")[0]["item_id"]]
    proxy.completions, proxy.fail_at = 0, 1
    audited = invoke("audit", tmp_path / "one", "--url", proxy.url)
    assert audited.exit_code == 2 and audited.stderr.splitlines()[-1].endswith("cap is 6.")


def test_another_server_on_resume_is_refused(server, proxy: Proxy, http_run: Path) -> None:
    proxy.version = "99.0.0"  # the same address now answers as an upgraded server
    result = run(proxy.url, server[1], http_run)
    assert result.exit_code == 2, result.output
    assert "different contract" in result.output
    assert "backend.identity.version" in result.output


def test_a_slow_server_times_out_in_one_sentence(server, proxy: Proxy, tmp_path) -> None:
    proxy.delay = 3.0
    result = run(proxy.url, server[1], tmp_path / "run", "matched", "--timeout", 1)
    assert result.exit_code == 2, result.output
    assert "did not answer" in result.output and not (tmp_path / "run").exists()


def test_unreachable_and_foreign_servers_are_refused(tmp_path: Path, server) -> None:
    result = run(f"http://127.0.0.1:{free_port()}", server[1], tmp_path / "a")
    assert result.exit_code == 2 and "did not answer" in result.output
    assert not (tmp_path / "a").exists()
    foreign = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{foreign.server_address[1]}"
        result = run(url, server[1], tmp_path / "b")
        assert result.exit_code == 2 and "is not one kvreplay knows" in result.output
        probe = invoke("probe", "--url", url)
        assert probe.exit_code == 2 and "Traceback" not in probe.output
    finally:
        foreign.shutdown()
        foreign.server_close()
