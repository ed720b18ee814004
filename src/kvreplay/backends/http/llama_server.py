"""The http backend's adapter for llama.cpp's server (``llama-server``): identity from
``/props``, a miss as a request with ``cache_prompt`` off on its pinned slot, a hit's
cached tokens from ``timings.cache_n``, and slot save/restore where the server was started
with ``--slot-save-path``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvreplay.backends.http.answers import MAX_COUNT
from kvreplay.backends.http.server import Client, Probe, answer_limit, metric_sums
from kvreplay.backends.served import TOP_LOGPROBS, Completion, Request, Sampled
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Sampling

# What llama-server's /metrics (--metrics) says is in flight, by kvreplay's names.
LLAMA_LOAD = {"llamacpp:requests_processing": "running", "llamacpp:requests_deferred": "waiting"}
MAX_PATH = 4096  # characters of the model path the server reports (its name is recorded)

NO_ROLLOUT = (
    "The server at {url} (llama-server) reports log(p) of a float32 softmax probability, "
    "floored at the smallest float, not a sampled token's log-probability, so it is not yet "
    "a rollout stack; sample with --backend llamacpp or a vllm serve."
)


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
    salts: ClassVar[bool] = False  # a slot keeps no salt: requests on it share its prefix

    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._used: set[int] = set()  # slots that served a request since the last reset

    @classmethod
    def recognises(cls, client: Client) -> bool:
        status, payload = client.call("GET", "/props")
        return status == 200 and payload.has("build_info")

    def probe(self) -> Probe:
        props = self.client.ok("GET", "/props")
        generation = props.get("default_generation_settings")
        context = generation.get("n_ctx") if generation is not None else None
        slots, ftype = props.get("total_slots"), props.get("model_ftype")
        settings: dict[str, Any] = {
            "block_size": 1,  # a hit reuses the common prefix token by token
            "max_model_len": context.integer(1, MAX_COUNT) if context else None,
            "total_slots": slots.integer(1, MAX_COUNT) if slots else None,
            "model_ftype": ftype.text() if ftype else None,
        }
        identity = {
            "version": props["build_info"].text(),
            "model": Path(props["model_path"].text(MAX_PATH)).name,
            "settings": settings,
        }
        timings = self.client.ok("POST", "/completion", {"prompt": [0], "n_predict": 1}).get(
            "timings"
        )
        reports = timings is not None and timings.has("cache_n")
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
            text = self.client.ok("POST", "/apply-template", body)["prompt"].text(limit=None)
        else:
            text = text_or_messages
        body = {"content": text, "add_special": not chat, "parse_special": True}
        return [t.integer() for t in self.client.ok("POST", "/tokenize", body)["tokens"].list()]

    def complete(
        self, model: str, request: Request, eos: Sequence[int], slot: int
    ) -> tuple[list[int], list[list[tuple[int, float]]], Completion, int]:
        with self._lock:
            fresh = slot not in self._used
            self._used.add(slot)
        sampler = request.sampler
        cap = request.stage.max_new_tokens
        body: dict[str, Any] = {
            "prompt": list(request.context),
            "n_predict": cap,
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
        answer = self.client.ok("POST", "/completion", body, answer_limit(cap))
        probabilities = answer.get("completion_probabilities")
        steps = [
            sorted(((top["id"].integer(), top["logprob"].number())
                    for top in step["top_logprobs"].list()), key=lambda x: -x[1])
            for step in (probabilities.list() if probabilities is not None else [])
        ]  # fmt: skip
        stop_type = answer.get("stop_type")
        completion = Completion(
            "length" if stop_type is not None and stop_type.text() == "limit" else "stop"
        )
        tokens = [t.integer() for t in answer["tokens"].list()]
        return tokens, steps, completion, answer["timings"]["cache_n"].integer()

    def load(self) -> dict[str, float]:
        """From ``/metrics`` where the server was started with ``--metrics``, else the
        slots busy now (``/slots``)."""
        status, text = self.client.text("/metrics")
        if status == 200:
            return metric_sums(text, LLAMA_LOAD)
        status, slots = self.client.call("GET", "/slots")
        if status != 200 or slots.value is None:
            return {}
        busy = [slot.get("is_processing") for slot in slots.list()]
        return {"running": float(sum(b is not None and b.value is True for b in busy))}

    def traffic_slot(self, client: int) -> int:
        """The slots from the last down: the arm's is 0 and companions' the next ones
        (the server needs --parallel above the arm, its companions and the traffic)."""
        slots = self.client.ok("GET", "/props")["total_slots"].integer(1, MAX_COUNT)
        return slots - 1 - client

    def pool_tokens(self) -> int | None:
        return None  # each slot keeps its own K/V: no pool shared between requests

    def eviction_tokens(self, computed: int) -> int:
        """One unrelated prompt as long as P on the arm's slot replaces what it holds."""
        return computed

    def logprobs_mode(self) -> str | None:
        return None  # log(p) of a float32 softmax, floored: not yet read as a rollout's

    def sample(
        self, model: str, prompt: Sequence[int], sampling: Sampling, eos: Sequence[int]
    ) -> Sampled:
        raise KvreplayError(NO_ROLLOUT.format(url=self.client.url))

    def prompt_logprobs(self, model: str, ids: Sequence[int]) -> list[list[tuple[int, float]]]:
        raise KvreplayError(
            f"The server at {self.client.url} (llama-server) returns no prompt "
            "log-probabilities, so it cannot score."
        )

    def reload_weights(self, folder: str) -> None:
        raise KvreplayError(
            f"The server at {self.client.url} (llama-server) cannot reload its weights in "
            "place; restart it on the new weights instead."
        )
