"""A running server as kvreplay talks to it (design: server adapter, probe): JSON over
HTTP that fails in one sentence, what a server says it is and can do, and the interface
each server's adapter implements (``backends/<server>_server.py``, registered by name in
:data:`~kvreplay.backends.http.ADAPTERS`): knowing its endpoints for identity, cache
reset, tokenization and completions with token ids and top logprobs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvreplay.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.backends.served import Completion, Request


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
    remedies: dict[str, str] = field(default_factory=dict)  # how to start it with what it lacks

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
                f"size, so no hit or miss can be forced or verified{self._remedy('control')}."
            )
        if not self.reports_cached_tokens:
            return (
                f"The server at {url} does not report cached prompt tokens, so no hit can be "
                f"verified{self._remedy('cached_tokens')}."
            )
        if not self.tokenizes:
            return (
                f"The server at {url} has no /tokenize, so kvreplay cannot check that its "
                "token ids are the server's."
            )
        return None

    def _remedy(self, lack: str) -> str:
        return f"; start it with {self.remedies[lack]}" if lack in self.remedies else ""


class ServerAdapter(Protocol):
    """One server's endpoints: who it is, how its prefix cache is reset, how it tokenizes
    and completes from token ids, and (where it can) how a slot's state is saved and
    loaded back."""

    name: ClassVar[str]
    client: Client

    def __init__(self, client: Client) -> None: ...

    @classmethod
    def recognises(cls, client: Client) -> bool:
        """Whether the server at the client's address is this adapter's kind."""
        ...

    def probe(self) -> Probe: ...

    def reset(self) -> None:
        """Make every slot's or block's next request a miss."""

    def round_trip(self, slot: int) -> None:
        """Save a slot's state, erase it and load it back (or refuse in a sentence)."""

    def tokenize(self, text_or_messages: str | list[dict[str, str]], chat: bool) -> list[int]: ...

    def complete(
        self, model: str, request: Request, eos: Sequence[int], slot: int
    ) -> tuple[list[int], list[list[tuple[int, float]]], Completion, int]:
        """Tokens, each step's top logprobs, why it stopped, cached prompt tokens."""
        ...
