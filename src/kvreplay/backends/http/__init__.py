"""The http backend: a running OpenAI-compatible server, the one its users deploy with
their own flags (design: backend protocol, server adapter, probe, hit guard).

kvreplay sends token ids and reads token ids, top-2 logprobs and the prompt tokens the
server served from its prefix cache. The server's cache is reset before every arm of a
row (vLLM's ``POST /reset_prefix_cache``), so a hit reads only blocks its own arm wrote
and a miss reads none; the hit guard needs the server's block size. Both come with vLLM's
development endpoints (``VLLM_SERVER_DEV_MODE=1``), and the cached-token report with
``--enable-prompt-tokens-details``; ``kvreplay probe`` says what a server lacks. The
server's identity and every setting it reports that can change numerics go into the
run's contract; its address does not, so a run can be resumed or audited against the
same server at another address (``--url``).

A server adapter knows one server's endpoints (:class:`~.server.ServerAdapter`,
one module each, registered in :data:`ADAPTERS`): ``vllm serve`` and llama.cpp's
``llama-server`` (whose miss is a request with ``cache_prompt`` off); ``--server auto``
asks the server who it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from kvreplay.backends.base import SERVED, Backend, ModelRef, companions_setting, option
from kvreplay.backends.http.server import Client, Probe, ServerAdapter, parse_address
from kvreplay.backends.served import Reply, Request, served_stage
from kvreplay.backends.traffic import MAX_CLIENTS, NEW_TOKENS, REQUEST_SECONDS, Traffic, evict
from kvreplay.core.errors import KvreplayError
from kvreplay.core.registry import Registry, located

# Each server kvreplay knows, by the name ``--server`` takes: one adapter module each.
ADAPTERS: Registry[type[ServerAdapter]] = Registry(
    "server adapter",
    located(
        (
            "kvreplay.backends.http.vllm_server:VllmServer",
            "kvreplay.backends.http.llama_server:LlamaServer",
        )
    ),
)


def adapter_class(name: str) -> type[ServerAdapter]:
    return ADAPTERS.get(name)


def connect(url: str, server: str, timeout: float, api_key_env: str) -> ServerAdapter:
    """The adapter for the server at ``url`` (``auto``: the first that recognises it)."""
    if not url:
        raise KvreplayError("The http backend needs the server's address: give --url URL.")
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise KvreplayError(f"--api-key-env names {api_key_env}, which is not set.")
    client = Client(url, timeout, api_key)
    if server != "auto":
        return adapter_class(server)(client)
    for adapter in ADAPTERS.values():
        if adapter.recognises(client):
            return adapter(client)
    raise KvreplayError(
        f"The server at {url} is not one kvreplay knows ({', '.join(ADAPTERS)}); "
        "name it with --server if it is one of them."
    )


@dataclass(frozen=True)
class HttpBackend(Backend):
    """A running server, reached at ``url``; see the module docstring."""

    name = "http"
    summary = "a running server (vllm serve, llama-server): prefix-cache hit vs miss over HTTP"
    # companions go concurrently: batch composition attempted, not set; a rollout stack, a
    # scorer and a weight update where the server offers them (vllm serve; llama-server
    # refuses each in one sentence)
    capabilities = replace(SERVED, rollout=True, scoring=True, weight_update=True)
    connection = ("url", "api_key_env", "timeout")
    parallel_workers = False
    url: str = field(default="", metadata=option("--url", "The server's base address."))

    def near_tie(self, precision: str) -> float:
        """A server's kernels are its own (a GGUF's quantized ones among them): the
        widest bound any engine needs."""
        return 1.0

    api_key_env: str = field(
        default="", metadata=option("--api-key-env", "Environment variable holding its API key.")
    )
    server: str = field(
        default="auto",
        metadata=option("--server", f"Which server it is: auto or {', '.join(ADAPTERS)}."),
    )
    timeout: float = field(
        default=600.0,
        metadata=option("--timeout", "Seconds to wait for one response.", minimum=0, maximum=86400),
    )
    companions: int = companions_setting()
    traffic: int = field(
        default=0,
        metadata=option(
            "--traffic",
            "Loopback clients sending other prompts to the server while an arm that takes "
            "traffic runs (history; 0: none).",
            minimum=0,
            maximum=MAX_CLIENTS,
            elsewhere="it runs loopback clients against a server, and this backend has none "
            "(the in-process vllm engine serves one request list per step, so nothing could "
            "arrive beside an arm); use --backend http",
        ),
    )
    recorded: dict[str, Any] | None = None  # the identity a resumed or audited run recorded

    def validate(self) -> None:
        if self.url:
            parse_address(self.url)
        if self.server not in ("auto", *ADAPTERS):
            raise KvreplayError(f"--server must be auto or one of {', '.join(ADAPTERS)}.")
        if self.timeout == 0:
            raise KvreplayError("--timeout must be above 0 seconds.")

    @property
    def traffic_clients(self) -> int:
        return self.traffic

    @cached_property
    def adapter(self) -> ServerAdapter:
        return connect(self.url, self.server, self.timeout, self.api_key_env)

    @cached_property
    def probe(self) -> Probe:
        return self.adapter.probe()

    def contract(self) -> dict[str, Any]:
        """The server as it answers now (an audit compares it with the recorded one)."""
        return {
            "name": self.name,
            "server": self.probe.server,
            "identity": self.probe.identity,
            "companions": self.companions,
            **({"traffic": self.traffic} if self.traffic else {}),
            "kv_access": False,
        }

    @classmethod
    def version(cls, recorded: dict[str, Any], environment: dict[str, Any]) -> str:
        """The server's own build, as its identity recorded it."""
        return f"{recorded['server']} server {recorded['identity'].get('version', '?')}"

    @classmethod
    def from_contract(cls, data: dict[str, Any], connection: dict[str, Any]) -> Backend:
        return cls(
            server=data["server"],
            companions=data["companions"],
            traffic=data.get("traffic", 0),
            recorded=data["identity"],
            **connection,
        )

    def context_window(self, model_context: int) -> int:
        served = self.probe.identity["settings"].get("max_model_len") or model_context
        return min(model_context or served, served)

    def expected_hit(self, computed: int) -> int:
        """The server caches full blocks only: a hit reads every full block computed."""
        block = int(self.probe.identity["settings"]["block_size"])
        return computed // block * block

    def check_ready(self) -> None:
        refusal = self.probe.missing(self.url)
        if refusal is not None:
            raise KvreplayError(refusal)

    def check_model(self, spec: str, device: str, dtypes: tuple[str, ...]) -> None:
        """The server loads the model: kvreplay reads only its tokenizer and config (the
        core install, without transformers, can), and checks what the server serves."""
        self.check_ready()
        for precision in dtypes:
            self.check_precision(precision)
        slots = self.probe.identity["settings"].get("total_slots")
        if slots is not None and self.companions + self.traffic >= slots:
            traffic = f" and {self.traffic} traffic clients" if self.traffic else ""
            raise KvreplayError(
                f"The server at {self.url} has {slots} slot(s) for an arm, its "
                f"{self.companions} companions{traffic}; start it with --parallel "
                f"{self.companions + self.traffic + 1} or pass fewer."
            )

    def check_tokenization(
        self, spec: str, tokenizer: Any, prompts: list[Any], chat: bool | None
    ) -> None:
        """kvreplay's token ids must be the server's: every prompt is tokenized by both."""
        from kvreplay.core.items import chat_messages, encode_prompt, is_token_ids

        self.check_ready()
        for prompt in prompts:
            if is_token_ids(prompt):
                continue  # ids go to the engine as they are: nothing to tokenize
            ours = encode_prompt(tokenizer, prompt, chat)
            messages = chat_messages(tokenizer, prompt, chat)
            theirs = self.adapter.tokenize(
                prompt if messages is None else messages, messages is not None
            )
            if theirs != ours:
                raise KvreplayError(
                    f"The server at {self.url} tokenizes a prompt differently from --model's "
                    "tokenizer; give --model the model the server serves."
                )

    def check_precision(self, precision: str) -> None:
        served = self.probe.identity["settings"].get("dtype")
        if served is not None and served != precision:
            raise KvreplayError(
                f"The server at {self.url} serves {served}, not {precision}; "
                f"pass --dtypes {served}."
            )

    def open_served(self, model: ModelRef, precision: str) -> HttpServed:
        from kvreplay.core.stages import eos_ids
        from kvreplay.model.reading import (
            generation_config,
            load_tokenizer,
            text_config,
            vocabulary_size,
        )
        from kvreplay.model.sources import resolve_source

        fresh = connect(self.url, self.server, self.timeout, self.api_key_env).probe()
        if fresh.identity != (self.recorded or self.probe.identity):
            raise KvreplayError(
                f"The server at {self.url} is not the one the run recorded (its version, "
                "model or settings differ)."
            )
        self.check_ready()
        self.check_precision(precision)
        tokenizer = load_tokenizer(model.spec)
        folder, _ = resolve_source(model.spec)
        return HttpServed(
            self.adapter,
            str(self.probe.identity["model"]),
            tokenizer,
            eos_ids(tokenizer, generation_config(folder)),
            self.context_window(0),
            self.probe.restores,
            vocabulary_size(text_config(model.spec), tokenizer),
            int(self.probe.identity["settings"]["block_size"]),
        )

    def rollout_stack(self, opened: Any) -> Any:
        from kvreplay.backends.http.rollout import HttpRollout

        return HttpRollout(opened, self.rollout_logprobs(), f"http:{self.probe.server}")

    def rollout_logprobs(self) -> tuple[str, ...]:
        from kvreplay.backends.http.rollout import reported

        return reported(self.adapter.logprobs_mode(), self.url)

    def scorer(self, opened: Any, schedule: str = "prefill") -> Any:
        from kvreplay.backends.http.rollout import HttpPrefill

        if schedule != "prefill":
            raise KvreplayError("A server scores in one prefill only (no replay schedule).")
        return HttpPrefill(opened, f"http:{self.probe.server} prefill")

    def weight_updater(self, opened: Any, model_folder: str) -> Any:
        from kvreplay.backends.http.rollout import HttpUpdater

        return HttpUpdater(opened, model_folder)


@dataclass
class HttpServed:
    """The served-model interface over HTTP."""

    adapter: ServerAdapter
    model: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_length: int
    restores: bool
    vocabulary: int
    block_size: int

    def reset_cache(self) -> None:
        self.adapter.reset()

    @property
    def salts(self) -> bool:
        return self.adapter.salts

    def pool_tokens(self) -> int | None:
        return self.adapter.pool_tokens()

    def preemptions(self) -> float | None:
        return self.adapter.load().get("preemptions")

    def round_trip(self) -> None:
        """The arm's slot (0) saved and loaded back in place (only where ``restores``)."""
        self.adapter.round_trip(0)

    def serve(self, requests: Sequence[Request]) -> list[Reply]:
        """Requests together: sent concurrently, so the server may batch them (it decides)."""
        from kvreplay.core.stages import StopDetector

        def one(slot: int, request: Request) -> Reply:
            tokens, steps, completion, cached = self.adapter.complete(
                self.model, request, self.eos_token_ids, slot
            )
            detector = StopDetector(self.tokenizer, request.stage.stop, self.eos_token_ids)
            server = f"The server at {self.adapter.client.url}"
            return served_stage(
                request, tokens, steps, completion, cached, detector, server, self.vocabulary
            )

        if len(requests) == 1:
            return [one(0, requests[0])]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(one, range(len(requests)), requests))

    def _sender(self, slots: Callable[[int], int]) -> Callable[[list[int], int], None]:
        """Sends a prompt for a short greedy completion on the slot a client maps to,
        through its own client with a short timeout: bounded like every request."""
        from kvreplay.core.sampler import Sampler
        from kvreplay.core.stages import Stage

        adapter = type(self.adapter)(self.adapter.client.with_timeout(REQUEST_SECONDS))
        stage = Stage("traffic", NEW_TOKENS)

        def send(prompt: list[int], client: int) -> None:
            request = Request(prompt[: self.context_length - NEW_TOKENS - 1], stage, Sampler())
            adapter.complete(self.model, request, self.eos_token_ids, slots(client))

        return send

    def traffic(self, clients: int, seed: str, prompts: Sequence[list[int]]) -> Traffic:
        slots = [self.adapter.traffic_slot(i) for i in range(clients)]
        send = self._sender(slots.__getitem__)
        monitor = type(self.adapter)(self.adapter.client.with_timeout(REQUEST_SECONDS))
        return Traffic(send, monitor.load, clients, seed, prompts, self.vocabulary)

    def evict(self, computed: int, seed: str) -> int:
        tokens = self.adapter.eviction_tokens(computed)
        longest = min(self.context_length - NEW_TOKENS - 1, max(tokens // 4, 1))
        return evict(self._sender(lambda _: 0), tokens, longest, seed, self.vocabulary)
