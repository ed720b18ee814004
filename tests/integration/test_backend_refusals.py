"""Backend refusals (issue 13) that need no engine: one sentence, exit 2, nothing written.
They hold in either environment; the one about a missing vLLM only where it is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import invoke


def refused(tmp_path: Path, *args: object) -> str:
    out = tmp_path / "run"
    result = invoke("run", *args, "--out", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    return result.output


@pytest.mark.parametrize("experiment", ["transplant", "localize", "bridge", "fixed-prefix"])
def test_kv_experiments_refused_on_a_server(tmp_path: Path, tiny_dirs, experiment: str) -> None:
    output = refused(
        tmp_path, experiment, "--model", tiny_dirs["qwen2"], "--backend", "http",
        "--url", "http://127.0.0.1:9",
    )  # fmt: skip
    assert "K/V tensors, which the http backend does not expose" in output
    assert "--backend hf" in output


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--block-size", 48, "multiple of 32"),
        ("--max-num-seqs", 0, "'--max-num-seqs': 0 is not in the range 1<=x<=1024"),
        ("--max-num-seqs", 5000, "'--max-num-seqs': 5000 is not in the range 1<=x<=1024"),
        ("--companions", 8, "--companions must be from 0 to 7"),
    ],
)
def test_bad_engine_settings(tmp_path: Path, tiny_dirs, option: str, value: int, message: str):
    output = refused(
        tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend", "vllm", option, value
    )
    assert message in output


def test_a_setting_of_another_backend_is_refused(tmp_path: Path, tiny_dirs) -> None:
    output = refused(tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--block-size", 64)
    assert "--block-size does not apply to the hf backend" in output


def test_http_workers_would_reset_each_others_cache(tmp_path: Path, tiny_dirs) -> None:
    output = refused(
        tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend", "http",
        "--url", "http://127.0.0.1:9", "--workers", "2",
    )  # fmt: skip
    assert "reset each other's prefix cache; run it with --workers 1." in output


def test_backends_lists_each_backend_with_its_capabilities() -> None:
    from helpers import invoke

    result = invoke("backends")
    assert result.exit_code == 0, result.output
    assert "hf (installed)" in result.output and "kv_access" in result.output
    assert "vllm (" in result.output and "cached_token_report" in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_not_installed(tmp_path: Path, tiny_dirs) -> None:
    output = refused(tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend", "vllm")
    assert "make setup-vllm" in output and "pip install 'kvreplay[vllm]' vllm" in output


class _ServerWithoutDevMode:
    """An error path only (never a stand-in in an end-to-end test): a loopback server that
    answers like vLLM started without VLLM_SERVER_DEV_MODE and prompt-token details."""

    def __enter__(self) -> str:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        answers = {
            "/version": {"version": "0.32.0"},
            "/v1/models": {"data": [{"id": "m", "max_model_len": 1024}]},
            "/v1/completions": {"choices": [{"text": "", "token_ids": [1]}], "usage": {}},
            "/tokenize": {"tokens": [1]},
        }

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.answer()

            def answer(self) -> None:
                body = answers.get(self.path)
                data = json.dumps(body or {"error": "not found"}).encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_probe_and_run_refuse_a_server_without_dev_mode(tmp_path: Path, tiny_dirs) -> None:
    from helpers import invoke

    with _ServerWithoutDevMode() as url:
        probe = invoke("probe", "--url", url)
        assert probe.exit_code == 2
        assert "resets its prefix cache        no" in probe.output
        assert "start it with VLLM_SERVER_DEV_MODE=1" in probe.output
        output = refused(tmp_path, "matched", "--model", tiny_dirs["qwen2"], "--backend",
                         "http", "--url", url)  # fmt: skip
        assert "start it with VLLM_SERVER_DEV_MODE=1" in output


@pytest.mark.parametrize("backend", ["hf", "llamacpp", "vllm"])
def test_traffic_needs_a_server(tmp_path: Path, tiny_dirs, backend: str) -> None:
    """--traffic on a backend with no server to send it to: one sentence saying why."""
    output = refused(
        tmp_path, "history", "--model", tiny_dirs["qwen2"], "--backend", backend, "--traffic", 2
    )
    assert len(output.strip().splitlines()) == 1, output
    assert f"--traffic does not apply to the {backend} backend: it runs loopback clients" in output


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, "-1 is not in the range"), (17, "17 is not in the range 0<=x<=16")],
)
def test_a_negative_or_huge_traffic_is_refused(tmp_path: Path, tiny_dirs, value, message) -> None:
    output = refused(
        tmp_path, "history", "--model", tiny_dirs["qwen2"], "--backend", "http",
        "--url", "http://127.0.0.1:9", "--traffic", value,
    )  # fmt: skip
    assert len(output.strip().splitlines()) == 1, output
    assert message in output


@pytest.mark.parametrize("command", [("run", "matched"), ("run", "resample")])
def test_traffic_is_refused_where_no_arm_runs_under_it(tmp_path: Path, tiny_dirs, command) -> None:
    out = tmp_path / "run"
    result = invoke(
        *command, "--model", tiny_dirs["qwen2"], "--backend", "http",
        "--url", "http://127.0.0.1:9", "--traffic", 2, "--out", out,
    )  # fmt: skip
    assert result.exit_code == 2 and not out.exists(), result.output
    assert "--traffic applies to history;" in result.output


def test_history_needs_a_server(tmp_path: Path, tiny_dirs) -> None:
    output = refused(tmp_path, "history", "--model", tiny_dirs["qwen2"])
    assert (
        "history needs --traffic, which the hf backend does not take; run it with --backend http."
        in output
    )
