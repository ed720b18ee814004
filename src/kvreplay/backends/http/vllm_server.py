"""The http backend's adapter for vLLM's OpenAI-compatible server (``vllm serve``): the
identity and numerics-relevant settings from ``/version``, ``/v1/models`` and the
development endpoint ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``, which also enables
``/reset_prefix_cache``), cached prompt tokens from ``usage.prompt_tokens_details``
(``--enable-prompt-tokens-details``), token ids in and out of ``/v1/completions``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from kvreplay.backends.http.answers import MAX_COUNT, Answer, shown
from kvreplay.backends.http.server import Client, Probe, answer_limit, metric_sums, prometheus
from kvreplay.backends.served import TOP_LOGPROBS, Completion, Request, Sampled
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Sampling

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


# What vLLM's /metrics says is in flight, by kvreplay's names (vllm/v1/metrics/loggers.py).
VLLM_LOAD = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_preemptions_total": "preemptions",
}

# Settings kvreplay computes with: counts that must be positive integers.
COUNTS = ("block_size", "max_model_len")


class VllmServer:
    """vLLM's OpenAI-compatible server (``vllm serve``)."""

    name: ClassVar[str] = "vllm"
    salts: ClassVar[bool] = True  # /v1/completions takes cache_salt

    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    def recognises(cls, client: Client) -> bool:
        status, payload = client.call("GET", "/version")
        return status == 200 and payload.has("version")

    def probe(self) -> Probe:
        version = self.client.ok("GET", "/version")["version"].text()
        models = self.client.ok("GET", "/v1/models")["data"].list()
        if not models:
            raise KvreplayError(f"The server at {self.client.url} serves no model.")
        model = models[0]
        served_length = model.get("max_model_len")
        settings: dict[str, Any] = {
            "max_model_len": served_length.integer(1, MAX_COUNT) if served_length else None
        }
        status, info = self.client.call("GET", "/server_info?config_format=json")
        if status == 200:
            settings |= self._settings(info)
        identity = {"version": version, "model": model["id"].text(), "settings": settings}
        reports = self._reports_cached_tokens(identity["model"])
        tokenizes = self.client.call("POST", "/tokenize", {"prompt": "a"})[0] == 200
        can_reset = self.client.call("POST", "/reset_prefix_cache")[0] == 200
        return Probe(
            self.name, identity, settings.get("block_size") is not None, can_reset, reports,
            tokenizes,
            remedies={
                "control": "VLLM_SERVER_DEV_MODE=1",
                "cached_tokens": "--enable-prompt-tokens-details",
            },
        )  # fmt: skip

    @staticmethod
    def _settings(info: Answer) -> dict[str, Any]:
        """The numerics-relevant settings ``/server_info`` reports, each a scalar (the
        counts kvreplay computes with: positive integers)."""
        config = info["vllm_config"]
        settings: dict[str, Any] = {}
        for section, key in VLLM_SETTINGS:
            part = config.get(section)
            value = part.get(key) if part is not None else None
            if value is None:
                settings[key] = None
            elif key in COUNTS:
                settings[key] = value.integer(1, MAX_COUNT)
            else:
                settings[key] = value.scalar()
        settings["dtype"] = DTYPE_NAMES.get(str(settings["dtype"]), settings["dtype"])
        return settings

    def _reports_cached_tokens(self, model: str) -> bool:
        body = {"model": model, "prompt": [0], "max_tokens": 1, "temperature": 0}
        usage = self.client.ok("POST", "/v1/completions", body).get("usage")
        details = usage.get("prompt_tokens_details") if usage is not None else None
        return details is not None and details.get("cached_tokens") is not None

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
        return [t.integer() for t in self.client.ok("POST", "/tokenize", body)["tokens"].list()]

    def complete(
        self, model: str, request: Request, eos: Sequence[int], slot: int
    ) -> tuple[list[int], list[list[tuple[int, float]]], Completion, int]:
        sampler = request.sampler
        cap = request.stage.max_new_tokens
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(request.context),
            "max_tokens": cap,
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
        if request.salt:
            body["cache_salt"] = request.salt
        answer = self.client.ok("POST", "/v1/completions", body, answer_limit(cap))
        choices = answer["choices"].list()
        if not choices:
            answer["choices"].refuse("is empty")
        choice = choices[0]
        logprobs = choice.get("logprobs")
        steps = [_top(step) for step in (logprobs["top_logprobs"].list() if logprobs else [])]
        finish = choice.get("finish_reason")
        completion = Completion(finish.text() if finish else None)
        tokens = [t.integer() for t in choice["token_ids"].list()]
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].integer()
        return tokens, steps, completion, cached

    def logprobs_mode(self) -> str | None:
        """Which log-probability the server reports of a sampled token (its
        ``--logprobs-mode``: raw_logprobs, processed_logprobs, ...), where it says."""
        status, info = self.client.call("GET", "/server_info?config_format=json")
        if status != 200:
            return None
        mode = info["vllm_config"].get("model_config")
        mode = mode.get("logprobs_mode") if mode is not None else None
        return None if mode is None else mode.text()

    def sample(
        self, model: str, prompt: Sequence[int], sampling: Sampling, eos: Sequence[int]
    ) -> Sampled:
        """One seeded completion from token ids: each sampled token and the
        log-probability the server reported for it, the top-1/top-2 gap, why it stopped
        and the cached prompt tokens."""
        body: dict[str, Any] = {
            "model": model, "prompt": list(prompt), "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1, "logprobs": TOP_LOGPROBS,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": [] if sampling.ignore_eos else sorted(eos),
            "skip_special_tokens": False,
        }  # fmt: skip
        if not sampling.greedy:
            body["seed"] = sampling.seed
        answer = self.client.ok("POST", "/v1/completions", body, answer_limit(sampling.max_tokens))
        choice = answer["choices"].list()[0] if answer["choices"].list() else None
        if choice is None:
            answer["choices"].refuse("is empty")
        tokens = [t.integer() for t in choice["token_ids"].list()]
        logprobs = choice["logprobs"]
        values = [v.number() for v in logprobs["token_logprobs"].list()]
        tops = [_top(step) for step in logprobs["top_logprobs"].list()]
        if len(values) != len(tokens) or len(tops) != len(tokens):
            logprobs.refuse(f"holds log-probabilities for other than its {len(tokens)} tokens")
        margins = [top[0][1] - top[1][1] if len(top) > 1 else math.inf for top in tops]
        finish = choice.get("finish_reason")
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].integer()
        return Sampled(tokens, values, margins, finish.text() if finish else None, cached)

    def prompt_logprobs(self, model: str, ids: Sequence[int]) -> list[list[tuple[int, float]]]:
        """The server's own prefill of ``ids`` (a request with ``prompt_logprobs``, which
        vLLM never serves from its prefix cache): at each position after the first, the
        log-probability of the token there and of the top two, best first."""
        body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": TOP_LOGPROBS, "return_token_ids": True}  # fmt: skip
        answer = self.client.ok("POST", "/v1/completions", body, answer_limit(len(ids)))
        steps = answer["choices"].list()[0]["prompt_logprobs"].list()[1:]
        found = []
        for step in steps:
            pairs = [(_id(key, step), value["logprob"].number()) for key, value in step.items()]
            found.append(sorted(pairs, key=lambda x: -x[1]))
        return found

    def reload_weights(self, folder: str) -> None:
        """Reload the engine's weights in place from a folder (vLLM's workers'
        ``reload_weights``, through the development route ``/collective_rpc``)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        self.client.ok("POST", "/collective_rpc", body)

    def load(self) -> dict[str, float]:
        status, text = self.client.text("/metrics")
        return metric_sums(text, VLLM_LOAD) if status == 200 else {}

    def traffic_slot(self, client: int) -> int:
        return 0  # vLLM has no slots: the scheduler places every request

    def pool_tokens(self) -> int | None:
        """The K/V pool less vLLM's null block, from ``/metrics``."""
        status, text = self.client.text("/metrics")
        pool = _pool(text) if status == 200 else None
        return (pool[0] - 1) * pool[1] if pool and pool[0] > 1 else None

    def eviction_tokens(self, computed: int) -> int:
        """The pool less half of P: the free blocks are used first, then P's least
        recently used ones (its tail blocks first), so about half of P's blocks go."""
        status, text = self.client.text("/metrics")
        pool = _pool_tokens(text) if status == 200 else None
        if pool is None:
            raise KvreplayError(
                f"The server at {self.client.url} does not report its K/V pool's size "
                "(vllm:cache_config_info in /metrics), so no eviction can be sized."
            )
        return max(pool - computed // 2, 1)


def _top(step: Answer) -> list[tuple[int, float]]:
    """One step's top logprobs, best first; vLLM names each token ``token_id:N``."""
    if step.value is None:
        return []
    top = []
    for key, logprob in step.items():
        prefix, _, number = key.partition(":")
        if prefix != "token_id" or not (number.isascii() and number.isdigit()) or len(number) > 12:
            step.refuse(f"names a token {shown(key)}, not token_id:N")
        top.append((int(number), logprob.number()))
    return sorted(top, key=lambda x: -x[1])


def _id(key: str, step: Answer) -> int:
    """A prompt log-probability's token id (vLLM keys them by the id's digits)."""
    if not (key.isascii() and key.isdigit()) or len(key) > 12:
        step.refuse(f"names a token {shown(key)}, not its id")
    return int(key)


def _pool(text: str) -> tuple[int, int] | None:
    """The K/V pool's blocks and block size, from ``vllm:cache_config_info``'s labels."""
    for labels, _ in prometheus(text).get("vllm:cache_config_info", []):
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            return int(blocks), int(size)
    return None


def _pool_tokens(text: str) -> int | None:
    """The K/V pool's size in tokens (vLLM's null block included)."""
    pool = _pool(text)
    return pool[0] * pool[1] if pool else None
