"""Issue 45: untrusted input, third round. Each family the issue names, reproduced through
the command line as a hostile server, a hostile run folder or a careless-but-honest user
would meet it, and each now ends as it must: one sentence on stderr and exit 2 before
anything is written (nothing half-written left looking complete), or an audit that names
the file and field at fault; and an honest sequence of commands always audits.

The families: a secret a server echoes back; code from a folder beside the run; "exact
pins" that are not ASCII; outputs onto inputs by other routes; tracebacks; an audit that
passes what it should name; vacuous runs that exit 0; an honest resume the audit failed;
items ``cut-refeed`` writes that no run accepts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import QUICK, assert_one_sentence, check, invoke, run_args
from loopback import Loopback, Reply, Sent, TinyVllm

SECRET = "sk-round3-0123456789abcdef"
KEY_ENV = "KVREPLAY_ROUND3_KEY"


# Family 1: a secret that comes back.
def _echoing(field: str, echo: Callable[[str], Any]) -> Callable[[Sent], Reply]:
    """A vLLM-dialect server whose answer puts ``echo(Authorization header)`` in ``field``
    (``version``, ``model`` or ``block_size``'s neighbour ``cache_dtype``)."""

    def route(sent: Sent) -> Reply:
        header = sent.headers.get("Authorization", "")
        said = echo(header)
        answers: dict[str, Any] = {
            "/version": {"version": said if field == "version" else "0.32.0"},
            "/v1/models": {"data": [{"id": said if field == "model" else "m",
                                     "max_model_len": 1024}]},
            "/server_info": {"vllm_config": {
                "cache_config": {"block_size": 16, "enable_prefix_caching": True,
                                 "cache_dtype": said if field == "setting" else "auto"},
                "model_config": {"dtype": "torch.float32"}}},
            "/v1/completions": {"choices": [{"token_ids": [1]}],
                                "usage": {"prompt_tokens_details": {"cached_tokens": 0}}},
            "/tokenize": {"tokens": [1]},
        }  # fmt: skip
        path = sent.path.split("?")[0]
        if path == "/reset_prefix_cache":
            return Reply(200)
        return Reply.json(answers.get(path, {"error": "no"}), 200 if path in answers else 404)

    return route


ECHOES: dict[str, Callable[[str], str]] = {
    "header": lambda header: header,
    "key_alone": lambda header: header.removeprefix("Bearer "),
    "upper_case": lambda header: header.upper(),
    "a_piece": lambda header: "build-" + header[7:21],
    "spaced": lambda header: " ".join(header.removeprefix("Bearer ")),
    "hex": lambda header: header.removeprefix("Bearer ").encode().hex()[:60],
}


@pytest.mark.parametrize("field", ["version", "model", "setting"])
@pytest.mark.parametrize("echo", list(ECHOES))
def test_a_server_that_echoes_the_key_is_refused_without_showing_it(
    field: str, echo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Loopback(_echoing(field, ECHOES[echo])) as server:
        result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "holds the API key (--api-key-env) or another secret")
    for shown in (SECRET, SECRET[3:15], SECRET.upper()[3:15]):
        assert shown not in result.output


def test_a_run_against_an_echoing_server_writes_nothing(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    server = TinyVllm(tiny_dirs["qwen2"])
    try:
        server.hostile("/version", lambda path, answer: {"version": f"0.1 ({SECRET})"}, -1)
        args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
        result = invoke(*args, "--backend", "http", "--url", server.url, "--dtypes", "fp32",
                        "--companions", "0", "--api-key-env", KEY_ENV)  # fmt: skip
    finally:
        server.close()
    check(result, "its version holds the API key", out)
    assert SECRET not in result.output
    assert not (out / "manifest.json").exists()


def test_another_credential_of_this_process_is_withheld_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No --api-key-env: a token this process holds (HF_TOKEN) echoed in the model id."""
    token = "hf_round3TOKENabcdefghij"
    monkeypatch.setenv("HF_TOKEN", token)
    with Loopback(_echoing("model", lambda header: f"org/{token}")) as server:
        result = invoke("probe", "--url", server.url)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "its data[0].id holds the API key")
    assert token not in result.output


def test_an_honest_server_with_a_key_is_not_refused(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Loopback(_echoing("version", lambda header: "0.32.0")) as server:
        result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
    assert result.exit_code == 0, result.output


# Family 2: code from a folder beside the run.
def _shipped_venv(folder: Path, marker: Path) -> Path:
    """A ready-made virtual environment whose ``.pth`` and ``pip`` would touch ``marker``."""
    site = folder / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    (site / "evil.pth").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    (folder / "bin").mkdir()
    pip = folder / "bin" / "pip"
    pip.write_text(f"#!/bin/sh\ntouch {marker}\n")
    pip.chmod(0o755)
    return folder


@pytest.mark.parametrize("shape", ["venv", "empty_pyvenv", "symlink"])
def test_env_never_runs_a_folder_it_did_not_create(
    shape: str, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    venv = tmp_path / ".venv-run"
    if shape == "venv":
        _shipped_venv(venv, marker)
    elif shape == "empty_pyvenv":
        venv.mkdir()
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    else:
        os.symlink(_shipped_venv(tmp_path / "elsewhere", marker), venv)
    result = invoke("env", run, "--venv", venv.name)
    assert result.exit_code == 2, result.output
    expected = "is a symbolic link" if shape == "symlink" else "already holds files"
    assert_one_sentence(result.stderr, expected)
    assert "$ " not in result.output and not marker.exists()


# Family 3: "exact pins" that are not ASCII.
NOT_ASCII = {
    "full_width_digits": "\uff12.\uff10.\uff11",
    "arabic_indic_digits": "\u0662.\u0660",
    "devanagari_digits": "\u0968.\u0966",
    "kelvin_sign_local_label": "2.0+\u212a",
    "long_s_post_release": "2.0.po\u017ft1",
    "dotless_i_pre_release": "2.0b\u0131",
    "superscript_digit": "2.0\u00b2",
    "full_width_epoch": "\uff11!2.0",
}


@pytest.mark.parametrize("case", list(NOT_ASCII))
def test_a_pin_that_is_not_ascii_is_refused_by_env_and_failed_by_audit(
    case: str, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = json.loads((run / "manifest.json").read_text())
    data["environment"]["distributions"]["numpy"] = NOT_ASCII[case]
    (run / "manifest.json").write_text(json.dumps(data, indent=2))
    for args in (["env", run], ["env", run, "--venv", tmp_path / "v"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert_one_sentence(result.stderr, "which is not an exact pin of a package on the index")
        assert not (tmp_path / "v").exists()
    audited = invoke("audit", run, "--sample", 0)
    assert audited.exit_code == 1, audited.output
    assert "manifest.json: field environment is malformed" in audited.stdout


def test_an_ascii_pin_in_upper_case_is_still_a_pin(run: Path) -> None:
    data = json.loads((run / "manifest.json").read_text())
    data["environment"]["distributions"]["numpy"] = "2.0RC1"
    (run / "manifest.json").write_text(json.dumps(data, indent=2))
    assert invoke("env", run).exit_code == 0
