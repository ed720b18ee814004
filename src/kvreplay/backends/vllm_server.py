"""The http backend's adapter for vLLM's OpenAI-compatible server (``vllm serve``): the
identity and numerics-relevant settings from ``/version``, ``/v1/models`` and the
development endpoint ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``, which also enables
``/reset_prefix_cache``), cached prompt tokens from ``usage.prompt_tokens_details``
(``--enable-prompt-tokens-details``), token ids in and out of ``/v1/completions``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvreplay.backends.served import TOP_LOGPROBS, Completion, Request
from kvreplay.backends.server import Client, Probe
from kvreplay.errors import KvreplayError

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
        return Probe(
            self.name, identity, status == 200, can_reset, reports, tokenizes,
            remedies={
                "control": "VLLM_SERVER_DEV_MODE=1",
                "cached_tokens": "--enable-prompt-tokens-details",
            },
        )  # fmt: skip

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
