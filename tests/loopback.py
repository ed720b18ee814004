"""Servers on loopback for the http backend's hostile-server tests (issue 34): real
sockets in threads of the test process, each stopped by its test.

:class:`Loopback` answers every request with a function of the test's choosing (a
redirect, a body without end, an answer trickled a byte at a time, malformed JSON) and
records what it was sent. :class:`TinyVllm` is a small OpenAI-compatible server in the
dialect of ``vllm serve`` over a real tiny model (transformers, fp32, greedy): every
completion is computed by the model, and its prefix cache reports the tokens vLLM would
reuse (full blocks of what earlier requests computed, never a prompt's last token). A
test makes it hostile by rewriting one kind of answer from its Nth completion on, so a
run has completed rows before the first hostile answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from kvreplay.backends.hf.loading import load_model
from kvreplay.core.items import encode_prompt


@dataclass
class Sent:
    """One request a loopback server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Reply:
    """What a loopback server sends: a status, headers and a body (bytes, or chunks
    written one after another with ``pause`` seconds between them)."""

    status: int = 200
    body: bytes | Iterator[bytes] = b""
    headers: dict[str, str] = field(default_factory=dict)
    pause: float = 0.0
    raw: bool = False  # the chunks are the whole response, status line and headers too

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(value).encode(), {"Content-Type": "application/json"})


Route = Callable[[Sent], Reply]


class Loopback:
    """A threaded HTTP server on 127.0.0.1 and a free port, answering with ``route``."""

    def __init__(self, route: Route) -> None:
        self.route, self.sent = route, []
        self.stopping = threading.Event()
        loopback = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.answer(None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.answer(json.loads(raw) if raw else None)

            def answer(self, body: Any) -> None:
                sent = Sent(self.command, self.path, dict(self.headers), body)
                loopback.sent.append(sent)
                reply = loopback.route(sent)
                try:
                    self.write(reply)
                except OSError:  # the client hung up: what a bounded client does
                    self.close_connection = True

            def write(self, reply: Reply) -> None:
                if not reply.raw:
                    self.send_response_only(reply.status)
                    self.head(reply)
                self.close_connection = True
                for chunk in [reply.body] if isinstance(reply.body, bytes) else reply.body:
                    if loopback.stopping.wait(reply.pause):
                        return
                    self.wfile.write(chunk)
                    self.wfile.flush()

            def head(self, reply: Reply) -> None:
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                if isinstance(reply.body, bytes) and "Content-Length" not in reply.headers:
                    self.send_header("Content-Length", str(len(reply.body)))
                self.send_header("Connection", "close")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def completion_answer(tokens: list[int], top: list[list[tuple[int, float]]], finish: str,
                      cached: int, prompt: int) -> dict[str, Any]:  # fmt: skip
    """A ``/v1/completions`` answer as vLLM writes it with token ids and top logprobs."""
    return {
        "choices": [{
            "index": 0,
            "token_ids": tokens,
            "logprobs": {"top_logprobs": [{f"token_id:{t}": lp for t, lp in step}
                                          for step in top]},
            "finish_reason": finish,
            "stop_reason": None,
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(tokens),
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }  # fmt: skip


Tamper = Callable[[str, dict[str, Any]], Any]


class TinyVllm(Loopback):
    """See the module docstring. ``tamper(path, answer)`` rewrites the answer to each
    request to ``path`` once ``hostile_from`` completions have been served (0: from the
    first request on)."""

    BLOCK = 4
    CONTEXT = 512

    def __init__(self, model: Path) -> None:
        self.lm = load_model(str(model), "fp32")
        self.cache: list[list[int]] = []  # what earlier requests computed since a reset
        self.completions = 0
        self.tamper: tuple[str, Tamper, int] | None = None
        self.lock = threading.Lock()
        super().__init__(self.serve)

    def hostile(self, path: str, tamper: Tamper, start: int = 0) -> None:
        self.tamper = (path, tamper, start)

    def serve(self, sent: Sent) -> Reply:
        with self.lock:  # one model and one cache: requests are served one at a time
            path = sent.path.split("?")[0]
            answer = self.answer(path, sent.body)
            if path == "/v1/completions":
                self.completions += 1
            if self.tamper and self.tamper[0] == path and self.completions > self.tamper[2]:
                answer = self.tamper[1](path, answer)
            if isinstance(answer, Reply):
                return answer
            return Reply.json(answer) if answer is not None else Reply(200)

    def answer(self, path: str, body: Any) -> Any:
        if path == "/version":
            return {"version": "0.0.0-tiny"}
        if path == "/v1/models":
            return {"data": [{"id": "tiny", "max_model_len": self.CONTEXT}]}
        if path == "/server_info":
            return {"vllm_config": {
                "model_config": {"dtype": "torch.float32", "max_model_len": self.CONTEXT,
                                 "seed": 0},
                "cache_config": {"block_size": self.BLOCK, "enable_prefix_caching": True,
                                 "cache_dtype": "auto"},
            }}  # fmt: skip
        if path == "/reset_prefix_cache":
            self.cache.clear()
            return None
        if path == "/tokenize":
            prompt = body.get("messages") or body["prompt"]
            return {"tokens": encode_prompt(self.lm.tokenizer, prompt, "messages" in body)}
        if path == "/v1/completions":
            return self.complete(body)
        return Reply.json({"error": "not found"}, 404)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        reused = max((_common(prompt, seen) for seen in self.cache), default=0)
        cached = min(reused, len(prompt) - 1) // self.BLOCK * self.BLOCK
        tokens: list[int] = []
        top: list[list[tuple[int, float]]] = []
        finish = "length"
        stop_ids, stops = set(body.get("stop_token_ids") or []), body.get("stop") or []
        with torch.inference_mode():
            for _ in range(int(body["max_tokens"])):
                logits = self.lm.model(torch.tensor([prompt + tokens])).logits[0, -1]
                best = torch.topk(torch.log_softmax(logits.float(), dim=-1), 2)
                tokens.append(int(best.indices[0]))
                top.append(
                    [(int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True)]
                )
                text = self.lm.tokenizer.decode(tokens, skip_special_tokens=False)
                if tokens[-1] in stop_ids or any(stop in text for stop in stops):
                    finish = "stop"
                    break
        self.cache.append(prompt + tokens[:-1])
        return completion_answer(tokens, top, finish, cached, len(prompt))


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two token sequences."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
