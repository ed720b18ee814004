"""Issue 34, classes 2-4: a server kvreplay is pointed at cannot take its key, exhaust it
or crash it, and cannot get a row recorded that its request could not have produced.

Every server here is a real socket on loopback (``tests/loopback.py``): hostile ones that
redirect, stream without end, trickle, echo the key or answer malformed JSON, and a small
vLLM-dialect server over a real tiny model whose answers a test rewrites from its Nth
completion on, so that a run has completed rows when the first hostile answer comes.
Each ends in one sentence and exit 2, with every completed row kept.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from helpers import assert_one_sentence, check, invoke, run_args
from loopback import Loopback, Reply, Sent, TinyVllm

from kvreplay.backends.http.server import MAX_ANSWER

SECRET = "sk-kvreplay-test-0123456789"
KEY_ENV = "KVREPLAY_TEST_KEY"


@pytest.fixture(scope="module")
def tiny(tiny_dirs: dict[str, Path]) -> Iterator[TinyVllm]:
    server = TinyVllm(tiny_dirs["qwen2"])
    yield server
    server.close()


@pytest.fixture
def served(tiny: TinyVllm) -> TinyVllm:
    """The tiny server, honest again and counting from zero."""
    tiny.tamper, tiny.completions = None, 0
    tiny.sent.clear()
    return tiny


def http_run(tmp: Path, model: Path, url: str, *extra: object) -> tuple[list[str], Path]:
    args, out = run_args("matched", tmp, model)
    return [*args, "--backend", "http", "--url", url, "--dtypes", "fp32", "--companions", "0",
            *map(str, extra)], out  # fmt: skip


def refused_mid_run(result: Result, expected: str) -> None:
    """Exit 2 and one sentence after the progress bar (which also writes to stderr)."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0] == result.stderr.splitlines()[-1], result.stderr
    assert errors[0].startswith("kvreplay: error: ") and expected in errors[0], errors


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_row_completions(
    tiny: TinyVllm, tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> int:
    """Completions a run serves up to the end of its first row (probes included)."""
    tiny.tamper, tiny.completions = None, 0
    args, _ = http_run(tmp_path_factory.mktemp("one"), tiny_dirs["qwen2"], tiny.url, "--n", 1)
    assert invoke(*args).exit_code == 0
    return tiny.completions


@pytest.fixture(scope="module")
def honest_run(
    tiny: TinyVllm, tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    tiny.tamper = None
    args, out = http_run(tmp_path_factory.mktemp("honest"), tiny_dirs["qwen2"], tiny.url)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return out


def test_an_honest_server_runs_and_audits(honest_run: Path, served: TinyVllm) -> None:
    """The baseline every hostile case departs from: hit and miss rows whose gates pass,
    and an audit against the same server that re-executes them."""
    assert len(rows(honest_run)) == 3
    for row in rows(honest_run):
        assert all(all(gate.values()) for gate in row["data"]["replicas"].values())
    audited = invoke("audit", honest_run, "--url", served.url)
    assert audited.exit_code == 0, audited.output


# Class 2: addresses and credentials.
URLS: dict[str, tuple[str, str]] = {
    "file": ("file:///etc/passwd", "--url must start with http:// or https://"),
    "ftp": ("ftp://127.0.0.1/", "--url must start with http:// or https://"),
    "no_scheme": ("127.0.0.1:8000", "--url must start with http:// or https://"),
    "password": ("http://user:hunter2-secret@127.0.0.1:9", "--url holds a user name or password"),
    "user": ("http://admin@127.0.0.1:9", "--url holds a user name or password"),
    "space": ("http://127.0.0.1:9/ v1", "--url holds a space or a control character"),
    "crlf": ("http://127.0.0.1:9/\r\nX-Injected: 1", "--url holds a space or a control"),
    "no_host": ("http://", "--url names no host"),
    "bad_port": ("http://127.0.0.1:99999", "--url is not an address"),
    "query": ("http://127.0.0.1:9/?key=sk-1", "--url holds a query or fragment"),
    "too_long": ("http://h/" + "a" * 3000, "--url is 3009 characters long"),
}


@pytest.mark.parametrize("case", list(URLS))
def test_urls_that_are_not_a_server_address(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    url, expected = URLS[case]
    probe = invoke("probe", "--url", url)
    assert probe.exit_code == 2, probe.output
    assert_one_sentence(probe.stderr, expected)
    assert "hunter2" not in probe.output and "sk-1" not in probe.output
    args, out = http_run(tmp_path, tiny_dirs["qwen2"], url)
    check(invoke(*args), expected, out)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_key_goes_nowhere(
    status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Loopback(lambda sent: Reply.json({"version": "1"})) as elsewhere:
        moved = lambda sent: Reply(status, headers={"Location": elsewhere.url + sent.path})  # noqa: E731
        with Loopback(moved) as server:
            result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
            assert server.sent and server.sent[0].headers["Authorization"] == f"Bearer {SECRET}"
        assert elsewhere.sent == []  # neither the key nor any request went there
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, f"with a redirect (HTTP {status}); kvreplay follows none")


def test_a_401_that_echoes_the_key_is_shown_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)

    def echo(sent: Sent) -> Reply:
        given = sent.headers.get("Authorization")
        return Reply.json({"error": f"bad key: Authorization: {given}; token={SECRET}"}, 401)

    with Loopback(echo) as server:
        result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV, "--server", "vllm")
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, "with HTTP 401 (bad key: Authorization: Bearer [redacted]")
    assert SECRET not in result.output and SECRET[-10:] not in result.output


def test_an_api_key_that_a_header_cannot_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-1\r\nX-Injected: 1")
    result = invoke("probe", "--url", "http://127.0.0.1:9", "--api-key-env", KEY_ENV)
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, "holds characters an HTTP header cannot carry")
    assert "X-Injected" not in result.output


def test_the_key_reaches_the_server_and_never_the_run_folder(
    served: TinyVllm, tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    args, out = http_run(tmp_path, tiny_dirs["qwen2"], served.url, "--n", 1,
                         "--api-key-env", KEY_ENV)  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert all(s.headers["Authorization"] == f"Bearer {SECRET}" for s in served.sent)
    assert SECRET not in result.output
    for path in out.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


# Class 3: what a server sends is bounded in size and time.
def _endless(chunk: bytes) -> Iterator[bytes]:
    return itertools.repeat(chunk)


def _json_of_length(key: str, length: int) -> Iterator[bytes]:
    yield f'{{"{key}": "'.encode()
    yield from itertools.repeat(b"x" * 2**16, length // 2**16)
    yield b'"}'


BOUNDS: dict[str, tuple[Callable[[], Reply], str]] = {
    "declared_100_mb": (
        lambda: Reply(200, _endless(b" " * 2**16), {"Content-Length": str(100 * 2**20)}),
        "with more than 4.0 MB, more than kvreplay reads of one answer",
    ),
    "endless_body": (
        lambda: Reply(200, _endless(b" " * 2**16)),
        "with more than 4.0 MB, more than kvreplay reads of one answer",
    ),
    "identity_of_100_mb": (
        lambda: Reply(200, _json_of_length("version", 100 * 2**20)),
        "with more than 4.0 MB, more than kvreplay reads of one answer",
    ),
    "identity_of_128_kb": (
        lambda: Reply(200, _json_of_length("version", 2**17)),
        "but its version is 131072 characters long (at most 256)",
    ),
    "identity_with_escapes": (
        lambda: Reply.json({"version": "1\x1b[2J\n2"}),
        "which holds control characters",
    ),
    "slow_body": (
        lambda: Reply(200, _endless(b" "), {"Content-Length": "100"}, pause=0.2),
        "did not answer GET /version within 1 seconds (--timeout)",
    ),
    "slow_headers": (
        lambda: Reply(body=_endless(b"X"), pause=0.2, raw=True),
        "did not answer GET /version within 1 seconds (--timeout)",
    ),
    "slow_endless_body": (
        lambda: Reply(200, _endless(b" "), pause=0.2),
        "did not answer GET /version within 1 seconds (--timeout)",
    ),
}


@pytest.mark.parametrize("case", list(BOUNDS))
def test_answers_too_large_or_too_slow_are_cut_off(case: str) -> None:
    reply, expected = BOUNDS[case]
    with Loopback(lambda sent: reply()) as server:
        result = invoke("probe", "--url", server.url, "--server", "vllm", "--timeout", 1)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, expected)
    assert len(result.output) < 1000  # probe prints nothing the server sent unbounded


def test_the_answer_limit_is_generous_for_real_answers() -> None:
    """A completion answer of the largest stage cap fits: vLLM writes about 60 bytes a
    token with top-2 logprobs, llama-server about 400."""
    assert MAX_ANSWER >= 1000 * len(json.dumps({"tokens": list(range(100_000, 100_300))}))


# Class 4: malformed answers about the server, refused by probe (and so before any run).
def _vllm(**override: Any) -> Callable[[Sent], Reply]:
    """A vLLM-dialect server's probe answers, some replaced (a Reply, or JSON)."""
    answers: dict[str, Any] = {
        "/version": {"version": "0.32.0"},
        "/v1/models": {"data": [{"id": "m", "max_model_len": 1024}]},
        "/server_info": {"vllm_config": {"cache_config": {"block_size": 16},
                                         "model_config": {"dtype": "torch.float32"}}},
        "/v1/completions": {"choices": [{"token_ids": [1]}],
                            "usage": {"prompt_tokens_details": {"cached_tokens": 0}}},
        "/tokenize": {"tokens": [1]},
        "/reset_prefix_cache": None,
    }  # fmt: skip
    answers |= {"/" + k.replace("__", "/"): v for k, v in override.items()}

    def route(sent: Sent) -> Reply:
        answer = answers.get(sent.path.split("?")[0], Reply.json({"error": "no"}, 404))
        return answer if isinstance(answer, Reply) else Reply.json(answer)

    return route


def _block(value: object) -> dict:
    return {"vllm_config": {"cache_config": {"block_size": value}}}


def _llama(**props: Any) -> Callable[[Sent], Reply]:
    base = {"build_info": "b1", "model_path": "/m/x.gguf", "total_slots": 4,
            "default_generation_settings": {"n_ctx": 8192}}  # fmt: skip
    return lambda sent: Reply.json(base | props)


PROBED: dict[str, tuple[Callable[[Sent], Reply], str]] = {
    "malformed_json": (
        _vllm(v1__models=Reply(200, b'{"data": [')),
        "answered GET /v1/models with something that is not JSON (malformed JSON",
    ),
    "nan": (
        _vllm(v1__models=Reply(200, b'{"data": [{"id": "m", "max_model_len": NaN}]}')),
        "NaN is not a JSON number",
    ),
    "unknown_server": (_vllm(version=Reply(200, b"<html>")), "is not one kvreplay knows"),
    "models_not_a_list": (_vllm(v1__models={"data": "m"}), "but its data is 'm', not a list"),
    "no_model": (_vllm(v1__models={"data": []}), "serves no model"),
    "block_size_zero": (_vllm(server_info=_block(0)), "block_size is 0, not from 1 to"),
    "block_size_text": (_vllm(server_info=_block("sixteen")), "is 'sixteen', not an integer"),
    "block_size_null": (_vllm(server_info=_block(None)), "nor reports its block size"),
    "block_size_float": (_vllm(server_info=_block(16.0)), "is 16.0, not an integer"),
    "context_negative": (
        _vllm(v1__models={"data": [{"id": "m", "max_model_len": -5}]}),
        "but its data[0].max_model_len is -5, not from 1 to",
    ),
    "setting_an_object": (
        _vllm(
            server_info={
                "vllm_config": {"cache_config": {"block_size": 16, "cache_dtype": {"a": 1}}}
            }
        ),
        "cache_dtype is {'a': 1}, not a number, string or flag",
    ),
    "config_a_list": (_vllm(server_info={"vllm_config": []}), "vllm_config is [], not a JSON"),
    "usage_a_string": (
        _vllm(v1__completions={"choices": [], "usage": "many"}),
        "but its usage is 'many', not a JSON object",
    ),
    "llama_numbers_as_text": (_llama(total_slots="four"), "total_slots is 'four', not an integer"),
    "llama_context_as_text": (
        _llama(default_generation_settings={"n_ctx": "8192"}),
        "default_generation_settings.n_ctx is '8192', not an integer",
    ),
    "llama_path_a_number": (_llama(model_path=7), "but its model_path is 7, not a string"),
}


@pytest.mark.parametrize("case", list(PROBED))
def test_malformed_answers_about_the_server(case: str) -> None:
    route, expected = PROBED[case]
    with Loopback(route) as server:
        result = invoke("probe", "--url", server.url)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, expected)


def test_a_tokenize_that_returns_strings_is_refused_before_the_manifest(
    served: TinyVllm, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    served.hostile("/tokenize", lambda path, answer: {"tokens": [str(t) for t in answer["tokens"]]})
    args, out = http_run(tmp_path, tiny_dirs["qwen2"], served.url)
    check(invoke(*args), "answered POST /tokenize, but its tokens[0] is '", out)
    assert not (out / "manifest.json").exists()


# Class 4: malformed or impossible completions, from the second row on.
def _choice(answer: dict) -> dict:
    return answer["choices"][0]


def _edit(change: Callable[[dict], None]) -> Callable[[str, dict], dict]:
    def tamper(path: str, answer: dict) -> dict:
        change(answer)
        return answer

    return tamper


def _tokens(
    extra: int = 0, drop: int = 0, finish: str | None = None
) -> Callable[[str, dict], dict]:
    """More tokens than asked (each with its logprobs), or fewer, as a server claims."""

    def change(answer: dict) -> None:
        choice = _choice(answer)
        steps = choice["logprobs"]["top_logprobs"]
        choice["token_ids"] = choice["token_ids"][: len(choice["token_ids"]) - drop] + [7] * extra
        choice["logprobs"]["top_logprobs"] = steps[: len(steps) - drop] + [steps[-1]] * extra
        choice["finish_reason"] = finish or choice["finish_reason"]

    return _edit(change)


def _set_token(value: object) -> Callable[[str, dict], dict]:
    return _edit(lambda answer: _choice(answer)["token_ids"].__setitem__(0, value))


def _cached(value: object) -> Callable[[str, dict], dict]:
    return _edit(lambda a: a["usage"]["prompt_tokens_details"].__setitem__("cached_tokens", value))


def _first_step(step: object) -> Callable[[str, dict], dict]:
    return _edit(lambda a: _choice(a)["logprobs"]["top_logprobs"].__setitem__(0, step))


def _second_best(answer: dict) -> None:
    """The greedy token swapped for the one its step ranks second (both in the vocabulary)."""
    choice = _choice(answer)
    ranked = sorted(choice["logprobs"]["top_logprobs"][0].items(), key=lambda kv: -kv[1])
    choice["token_ids"][0] = int(ranked[1][0].split(":")[1])


def _nan(path: str, answer: dict) -> Reply:
    step = _choice(answer)["logprobs"]["top_logprobs"][0]
    step[next(iter(step))] = float("nan")
    return Reply(200, json.dumps(answer).encode())  # json writes NaN, as a sloppy server does


COMPLETIONS: dict[str, tuple[Callable[[str, dict], Any], str]] = {
    "five_more_tokens": (_tokens(extra=5), "tokens for the stage think, whose cap is 6"),
    "three_fewer_tokens": (_tokens(drop=3), "no stop string or EOS token of the stage ends"),
    "three_fewer_said_stop": (
        _tokens(drop=3, finish="stop"), "says it finished by 'stop', but no stop string"
    ),
    "token_id_a_billion": (_set_token(10**9), "token id 1000000000, outside the model's vocab"),
    "token_id_negative": (_set_token(-1), "but its choices[0].token_ids[0] is -1, not at least 0"),
    "token_id_a_string": (_set_token("5"), "choices[0].token_ids[0] is '5', not an integer"),
    "token_id_a_float": (_set_token(5.0), "choices[0].token_ids[0] is 5.0, not an integer"),
    "cached_many": (_cached("many"), "cached_tokens is 'many', not an integer"),
    "cached_negative": (_cached(-4), "cached_tokens is -4, not at least 0"),
    "cached_past_the_prompt": (_cached(10**6), "reported 1000000 cached prompt tokens for a"),
    "empty_choices": (_edit(lambda a: a.__setitem__("choices", [])), "its choices is empty"),
    "no_choices": (_edit(lambda a: a.pop("choices")), "but its answer lacks choices"),
    "no_token_ids": (_edit(lambda a: _choice(a).pop("token_ids")), "choices[0] lacks token_ids"),
    "no_top_logprobs": (
        _edit(lambda a: _choice(a)["logprobs"].pop("top_logprobs")),
        "choices[0].logprobs lacks top_logprobs",
    ),
    "one_logprob": (_first_step({"token_id:5": -0.1}), "fewer than two logprobs for a step"),
    "logprob_key": (
        _first_step({"5": -0.1, "token_id:6": -1.0}), "names a token '5', not token_id:N"
    ),
    "logprob_a_string": (
        _first_step({"token_id:5": "-0.1", "token_id:6": -1.0}), "is '-0.1', not a number"
    ),
    "logprob_nan": (_nan, "NaN is not a JSON number"),
    "logprob_positive": (
        _first_step({"token_id:5": 3.0, "token_id:6": -1.0}), "not a finite number at most 0"
    ),
    "greedy_token_not_first": (_edit(_second_best), "but its logprobs rank another token above"),
    "no_cached_tokens": (
        _edit(lambda a: a["usage"].pop("prompt_tokens_details")),
        "but its usage lacks prompt_tokens_details",
    ),
    "answer_a_list": (lambda path, answer: [answer], "its answer is [{"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_an_impossible_completion_keeps_every_completed_row(
    case: str,
    served: TinyVllm,
    first_row_completions: int,
    tmp_path: Path,
    tiny_dirs: dict[str, Path],
) -> None:
    tamper, expected = COMPLETIONS[case]
    served.hostile("/v1/completions", tamper, start=first_row_completions)
    args, out = http_run(tmp_path, tiny_dirs["qwen2"], served.url)
    result = invoke(*args)
    refused_mid_run(result, f"The server at {served.url}")
    refused_mid_run(result, expected)
    kept = rows(out)
    assert [row["key"] for row in kept] == ["matched/b1/fp32"]  # the row before, whole
    if case == "five_more_tokens":  # the folder stays reusable: an honest server resumes it
        served.tamper = None
        resumed = invoke(*args)
        assert resumed.exit_code == 0, resumed.output
        assert rows(out)[:1] == kept and len(rows(out)) == 3


@pytest.mark.parametrize("case", ["five_more_tokens", "three_fewer_tokens", "token_id_a_billion",
                                  "logprob_nan", "cached_many"])  # fmt: skip
def test_audit_against_a_hostile_server_fails_in_one_sentence(
    case: str, served: TinyVllm, honest_run: Path
) -> None:
    served.hostile("/v1/completions", COMPLETIONS[case][0], start=1)  # the probe's is honest
    result = invoke("audit", honest_run, "--url", served.url)
    refused_mid_run(result, COMPLETIONS[case][1])
    assert "PASS" not in result.output
