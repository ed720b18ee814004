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

A server adapter knows one server's endpoints: :class:`VllmServer` (``vllm serve``) and
:class:`LlamaServer` (llama.cpp's ``llama-server``, whose miss is a request with
``cache_prompt`` off); ``--server auto`` asks the server who it is.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvreplay.backends.base import SERVED, Backend, companions_setting, option
from kvreplay.backends.served import TOP_LOGPROBS, Completion, Request, Served, served_stage
from kvreplay.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.config import RunConfig

# The server settings that can change a served row's numerics, as vLLM's
# /server_info?config_format=json reports them (section, key).
VLLM_SETTINGS = (
    ("model_config", "dtype"),
    ("model_config", "max_model_len"),
    ("model_config", "seed"),
    ("cache_config", "block_size"),
    ("cache_config", "enable_prefix_caching"),
    ("cache_config", "cache_dtype"),
    ("scheduler_config", "max_num_seqs"),
    ("scheduler_config", "max_num_batched_tokens"),
    ("scheduler_config", "enable_chunked_prefill"),
    ("compilation_config", "mode"),
    ("compilation_config", "cudagraph_mode"),
    ("parallel_config", "tensor_parallel_size"),
)
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class Client:
    """JSON over HTTP to one server: every failure is one sentence naming the address."""

    def __init__(self, url: str, timeout: float, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or None); a connection failure or timeout raises."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers=self.headers, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise KvreplayError(
                f"The server at {self.url} did not answer {method} {path} ({reason})."
            ) from exc
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, payload = self.call(method, path, body)
        if status != 200:
            detail = payload.get("error", payload) if isinstance(payload, dict) else payload
            raise KvreplayError(
                f"The server at {self.url} answered {method} {path} with HTTP {status}"
                f"{f' ({str(detail)[:200]})' if detail else ''}."
            )
        return payload


@dataclass(frozen=True)
class Probe:
    """What a server says it is and can do, asked before any run."""

    server: str
    identity: dict[str, Any]  # version, served model, numerics-relevant settings
    reports_settings: bool  # block size, dtype, ... (vLLM: dev mode)
    can_reset: bool  # vLLM: dev mode
    reports_cached_tokens: bool  # vLLM: --enable-prompt-tokens-details
    tokenizes: bool
    restores: bool = False  # saves a slot's state and loads it back (llama.cpp: --slot-save-path)

    def table(self) -> list[tuple[str, str]]:
        settings = self.identity.get("settings", {})
        yes = {True: "yes", False: "no"}
        return [
            ("server", self.server),
            ("version", str(self.identity.get("version"))),
            ("model", str(self.identity.get("model"))),
            ("dtype", str(settings.get("dtype", "not reported"))),
            ("block size", str(settings.get("block_size", "not reported"))),
            ("reports its settings", yes[self.reports_settings]),
            ("resets its prefix cache", yes[self.can_reset]),
            ("reports cached prompt tokens", yes[self.reports_cached_tokens]),
            ("tokenizes (/tokenize)", yes[self.tokenizes]),
            ("restores a saved slot state", yes[self.restores]),
        ]

    def missing(self, url: str) -> str | None:
        """The refusal a run gets from this server, or None when it has what a run needs."""
        if not (self.reports_settings and self.can_reset):
            return (
                f"The server at {url} neither resets its prefix cache nor reports its block "
                "size, so no hit or miss can be forced or verified; start it with "
                "VLLM_SERVER_DEV_MODE=1."
            )
        if not self.reports_cached_tokens:
            return (
                f"The server at {url} does not report cached prompt tokens, so no hit can be "
                "verified; start it with --enable-prompt-tokens-details."
            )
        if not self.tokenizes:
            return (
                f"The server at {url} has no /tokenize, so kvreplay cannot check that its "
                "token ids are the server's."
            )
        return None


class VllmServer:
    """vLLM's OpenAI-compatible server (``vllm serve``)."""

    name: ClassVar[str] = "vllm"

    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    def recognises(cls, client: Client) -> bool:
        status, payload = client.call("GET", "/version")
        return status == 200 and isinstance(payload, dict) and "version" in payload

    def probe(self) -> Probe:
        version = self.client.ok("GET", "/version").get("version")
        models = self.client.ok("GET", "/v1/models").get("data") or []
        if not models:
            raise KvreplayError(f"The server at {self.client.url} serves no model.")
        model = models[0]
        status, info = self.client.call("GET", "/server_info?config_format=json")
        settings: dict[str, Any] = {"max_model_len": model.get("max_model_len")}
        if status == 200 and isinstance(info, dict):
            config = info.get("vllm_config", {})
            for section, key in VLLM_SETTINGS:
                settings[key] = config.get(section, {}).get(key)
            settings["dtype"] = DTYPE_NAMES.get(str(settings["dtype"]), settings["dtype"])
        identity = {"version": version, "model": model.get("id"), "settings": settings}
        usage = self._usage(model["id"])
        reports = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is not None
        tokenizes = self.client.call("POST", "/tokenize", {"prompt": "a"})[0] == 200
        can_reset = self.client.call("POST", "/reset_prefix_cache")[0] == 200
        return Probe(self.name, identity, status == 200, can_reset, reports, tokenizes)

    def _usage(self, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": [0], "max_tokens": 1, "temperature": 0}
        return self.client.ok("POST", "/v1/completions", body).get("usage") or {}

    def reset(self) -> None:
        self.client.ok("POST", "/reset_prefix_cache")

    def round_trip(self, slot: int) -> None:
        raise KvreplayError(f"The server at {self.client.url} cannot restore a saved state.")

    def tokenize(self, text_or_messages: str | list[dict[str, str]], chat: bool) -> list[int]:
        body: dict[str, Any] = (
            {"messages": text_or_messages, "add_generation_prompt": True}
            if chat
            else {"prompt": text_or_messages, "add_special_tokens": True}
        )
        return [int(t) for t in self.client.ok("POST", "/tokenize", body)["tokens"]]

    def complete(
        self, model: str, request: Request, eos: Sequence[int], slot: int
    ) -> tuple[list[int], list[list[tuple[int, float]]], Completion, int]:
        sampler = request.sampler
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(request.context),
            "max_tokens": request.stage.max_new_tokens,
            "temperature": sampler.temperature,
            "top_p": sampler.top_p,
            "logprobs": TOP_LOGPROBS,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop": list(request.stage.stop),
            "stop_token_ids": sorted(eos),
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if not sampler.greedy:
            body["seed"] = sampler.seed
        answer = self.client.ok("POST", "/v1/completions", body)
        choice = answer["choices"][0]
        steps = [
            sorted(((int(t.split(":", 1)[1]), float(lp)) for t, lp in (top or {}).items()),
                   key=lambda x: -x[1])
            for top in (choice.get("logprobs") or {}).get("top_logprobs", [])
        ]  # fmt: skip
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        completion = Completion(choice.get("finish_reason"), choice.get("stop_reason"))
        tokens = [int(t) for t in choice.get("token_ids") or []]
        return tokens, steps, completion, int(details.get("cached_tokens") or 0)


class LlamaServer:
    """llama.cpp's server (``llama-server``). A slot keeps the K/V of its last request and
    a request with ``cache_prompt`` reuses their common prefix (``timings.cache_n``); one
    without reuses nothing. kvreplay pins an arm's requests to slot 0 and a companion's to
    slot i, and a reset makes each slot's next request one without: so a hit reads exactly
    what the arm's own earlier requests computed (every token but the last sampled), a
    miss nothing, and companions start from nothing too. The server needs ``--parallel``
    above the companions.

    Stop strings are not sent: llama-server drops the logprobs of a stop string's tokens,
    so a stage runs to its cap or EOS and the plan's stops cut it here. The slot then holds
    a stop token it decoded, so a plan whose prefix stages end at a stop string fails the
    hit guard (named in each row), never passes it silently.

    A server started with ``--slot-save-path`` can save a slot's state to a file and load
    it back: the hit's replica is then the live state the arm's own requests left, saved,
    erased and restored in place (a copy of that state, as an in-process replica is),
    rather than the whole arm served again."""

    name: ClassVar[str] = "llamacpp"

    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._used: set[int] = set()  # slots that served a request since the last reset

    @classmethod
    def recognises(cls, client: Client) -> bool:
        status, payload = client.call("GET", "/props")
        return status == 200 and isinstance(payload, dict) and "build_info" in payload

    def probe(self) -> Probe:
        props = self.client.ok("GET", "/props")
        generation = props.get("default_generation_settings") or {}
        settings = {
            "block_size": 1,  # a hit reuses the common prefix token by token
            "max_model_len": generation.get("n_ctx"),
            "total_slots": props.get("total_slots"),
            "model_ftype": props.get("model_ftype"),
        }
        identity = {
            "version": props.get("build_info"),
            "model": Path(str(props.get("model_path"))).name,
            "settings": settings,
        }
        answer = self.client.ok("POST", "/completion", {"prompt": [0], "n_predict": 1})
        reports = "cache_n" in (answer.get("timings") or {})
        tokenizes = self.client.call("POST", "/tokenize", {"content": "a"})[0] == 200
        # An empty file name is refused (400) by a server that saves slots, before it
        # touches one; a server without --slot-save-path refuses every slot action (501).
        restores = self.client.call("POST", "/slots/0?action=save", {"filename": ""})[0] == 400
        if restores:  # said only when on, so that a server without it keeps its identity
            settings["slot_save"] = True
        return Probe(self.name, identity, True, True, reports, tokenizes, restores)

    def reset(self) -> None:
        with self._lock:
            self._used.clear()

    def round_trip(self, slot: int) -> None:
        """Save the slot's state to the server's slot folder, erase the slot, load it back."""
        file = {"filename": f"kvreplay-slot{slot}.bin"}
        for action in ("save", "erase", "restore"):
            self.client.ok("POST", f"/slots/{slot}?action={action}", file)

    def tokenize(self, text_or_messages: str | list[dict[str, str]], chat: bool) -> list[int]:
        if chat:
            body = {"messages": text_or_messages, "add_generation_prompt": True}
            text = self.client.ok("POST", "/apply-template", body)["prompt"]
        else:
            text = text_or_messages
        body = {"content": text, "add_special": not chat, "parse_special": True}
        return [int(t) for t in self.client.ok("POST", "/tokenize", body)["tokens"]]

    def complete(
        self, model: str, request: Request, eos: Sequence[int], slot: int
    ) -> tuple[list[int], list[list[tuple[int, float]]], Completion, int]:
        with self._lock:
            fresh = slot not in self._used
            self._used.add(slot)
        sampler = request.sampler
        body: dict[str, Any] = {
            "prompt": list(request.context),
            "n_predict": request.stage.max_new_tokens,
            "temperature": sampler.temperature,
            "top_p": sampler.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "seed": sampler.seed,
            "n_probs": TOP_LOGPROBS,
            "cache_prompt": not fresh,
            "return_tokens": True,
            "id_slot": slot,
        }
        answer = self.client.ok("POST", "/completion", body)
        steps = [
            sorted(((int(t["id"]), float(t["logprob"])) for t in step.get("top_logprobs", [])),
                   key=lambda x: -x[1])
            for step in answer.get("completion_probabilities") or []
        ]  # fmt: skip
        completion = Completion("length" if answer.get("stop_type") == "limit" else "stop")
        tokens = [int(t) for t in answer.get("tokens") or []]
        return tokens, steps, completion, int((answer.get("timings") or {}).get("cache_n") or 0)


Adapter = VllmServer | LlamaServer
ADAPTERS: dict[str, type[Adapter]] = {VllmServer.name: VllmServer, LlamaServer.name: LlamaServer}


def connect(url: str, server: str, timeout: float, api_key_env: str) -> Adapter:
    """The adapter for the server at ``url`` (``auto``: the first that recognises it)."""
    if not url:
        raise KvreplayError("The http backend needs the server's address: give --url URL.")
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise KvreplayError(f"--api-key-env names {api_key_env}, which is not set.")
    client = Client(url, timeout, api_key)
    if server != "auto":
        return ADAPTERS[server](client)
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
    capabilities = SERVED  # companions go concurrently: batch composition attempted, not set
    connection = ("url", "api_key_env", "timeout")
    parallel_workers = False
    url: str = field(default="", metadata=option("--url", "The server's base address."))
    api_key_env: str = field(
        default="", metadata=option("--api-key-env", "Environment variable holding its API key.")
    )
    server: str = field(
        default="auto",
        metadata=option("--server", f"Which server it is: auto or {', '.join(ADAPTERS)}."),
    )
    timeout: float = field(
        default=600.0, metadata=option("--timeout", "Seconds to wait for one response.")
    )
    companions: int = companions_setting()
    recorded: dict[str, Any] | None = None  # the identity a resumed or audited run recorded

    def validate(self) -> None:
        if self.server not in ("auto", *ADAPTERS):
            raise KvreplayError(f"--server must be auto or one of {', '.join(ADAPTERS)}.")
        if not 0 < self.timeout <= 86400:
            raise KvreplayError("--timeout must be from 0 to 86400 seconds.")
        if not 0 <= self.companions <= 64:
            raise KvreplayError("--companions must be from 0 to 64.")

    @cached_property
    def adapter(self) -> Adapter:
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
            "kv_access": False,
        }

    @classmethod
    def from_contract(cls, data: dict[str, Any], connection: dict[str, Any]) -> Backend:
        return cls(
            server=data["server"],
            companions=data["companions"],
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

    def check_model(
        self, spec: str, trust_remote_code: bool, device: str, dtypes: tuple[str, ...]
    ) -> None:
        self.check_ready()
        for precision in dtypes:
            self.check_precision(precision)
        slots = self.probe.identity["settings"].get("total_slots")
        if slots is not None and self.companions >= slots:
            raise KvreplayError(
                f"The server at {self.url} has {slots} slot(s) for an arm and its "
                f"{self.companions} companions; start it with --parallel "
                f"{self.companions + 1} or pass --companions {slots - 1}."
            )

    def check_tokenization(
        self, spec: str, tokenizer: Any, prompts: list[Any], chat: bool | None
    ) -> None:
        """kvreplay's token ids must be the server's: every prompt is tokenized by both."""
        from kvreplay.items import chat_messages, encode_prompt

        self.check_ready()
        for prompt in prompts:
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

    def open_served(self, config: RunConfig, precision: str) -> HttpServed:
        from kvreplay.decode import eos_ids
        from kvreplay.models import generation_config, load_tokenizer
        from kvreplay.sources import resolve_source

        fresh = connect(self.url, self.server, self.timeout, self.api_key_env).probe()
        if fresh.identity != (self.recorded or self.probe.identity):
            raise KvreplayError(
                f"The server at {self.url} is not the one the run recorded (its version, "
                "model or settings differ)."
            )
        self.check_ready()
        self.check_precision(precision)
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        folder, _ = resolve_source(config.model, config.trust_remote_code)
        return HttpServed(
            self.adapter,
            str(self.probe.identity["model"]),
            tokenizer,
            eos_ids(tokenizer, generation_config(folder)),
            self.context_window(0),
            self.probe.restores,
        )


@dataclass
class HttpServed:
    """The served-model interface over HTTP."""

    adapter: Adapter
    model: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_length: int
    restores: bool

    def reset_cache(self) -> None:
        self.adapter.reset()

    def round_trip(self) -> None:
        """The arm's slot (0) saved and loaded back in place (only where ``restores``)."""
        self.adapter.round_trip(0)

    def serve(self, requests: Sequence[Request]) -> list[Served]:
        """Requests together: sent concurrently, so the server may batch them (it decides)."""
        from kvreplay.stages import StopDetector

        def one(slot: int, request: Request) -> Served:
            tokens, steps, completion, cached = self.adapter.complete(
                self.model, request, self.eos_token_ids, slot
            )
            detector = StopDetector(self.tokenizer, request.stage.stop, self.eos_token_ids)
            return served_stage(request, tokens, steps, completion, cached, detector, "The server")

        if len(requests) == 1:
            return [one(0, requests[0])]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(one, range(len(requests)), requests))
