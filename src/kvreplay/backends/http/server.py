"""A running server as kvreplay talks to it (design: server adapter, probe): JSON over
HTTP that fails in one sentence, what a server says it is and can do, and the interface
each server's adapter implements (``backends/<server>_server.py``, registered by name in
:data:`~kvreplay.backends.http.ADAPTERS`): knowing its endpoints for identity, cache
reset, tokenization and completions with token ids and top logprobs."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol
from urllib.parse import urlsplit

from kvreplay.backends.http.answers import Answer
from kvreplay.backends.http.secrets import Secrets
from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.jsonio import JsonError, parse_json

if TYPE_CHECKING:
    from kvreplay.backends.served import Completion, Request, Sampled
    from kvreplay.core.rollout import Sampling

MAX_ANSWER = 4 * 2**20
"""Bytes read of one answer about a server (identity, settings, tokens of a prompt, a
reset): vLLM and llama-server answer these in a few kB, and a tokenized prompt of a
hundred thousand tokens takes under 1 MB; more is refused, never read into memory."""
ANSWER_PER_TOKEN = 4096
"""Bytes a completion may add per token it may return: each token's id, text, bytes and
top logprobs take a few hundred bytes on either server."""
MAX_URL = 2048


def answer_limit(max_tokens: int) -> int:
    """Bytes read of a completion of at most ``max_tokens`` tokens."""
    return MAX_ANSWER + ANSWER_PER_TOKEN * max_tokens


@dataclass(frozen=True)
class Address:
    """A server's base address (``--url``): http or https, a host, a port and a path."""

    https: bool
    host: str
    port: int | None
    base: str  # the path every request goes below, without a final "/"
    url: str  # as sentences show it: it holds no credentials


def parse_address(url: str) -> Address:
    """``--url`` as an :class:`Address`, or one sentence on why it is not one. A user
    name or password in it is refused without being repeated: the key goes in
    ``--api-key-env``, never in the address a run records in its command."""
    if len(url) > MAX_URL:
        raise KvreplayError(f"--url is {len(url)} characters long (at most {MAX_URL}).")
    if not url.isprintable() or any(c.isspace() for c in url):
        raise KvreplayError("--url holds a space or a control character; give the address alone.")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise KvreplayError("--url is not an address (its host or port cannot be read).") from None
    if parts.scheme not in ("http", "https"):
        raise KvreplayError("--url must start with http:// or https://.")
    if parts.username is not None or parts.password is not None:
        raise KvreplayError(
            "--url holds a user name or password; give the address without them and the "
            "key with --api-key-env."
        )
    if not parts.hostname:
        raise KvreplayError("--url names no host.")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise KvreplayError("--url holds a query or fragment; give the server's base address.")
    base = parts.path.rstrip("/")
    return Address(parts.scheme == "https", parts.hostname, port, base, url.rstrip("/"))


class TooLarge(Exception):
    """An answer longer than the bytes a request may read."""


def read_bounded(response: http.client.HTTPResponse, limit: int) -> bytes:
    """A response's body, refused (:class:`TooLarge`) past ``limit`` bytes, whether
    it says its length or streams without end."""
    declared = (response.getheader("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge
    chunks, size = [], 0
    while chunk := response.read(min(1 << 16, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise TooLarge
    return b"".join(chunks)


SECRET_FORMS = re.compile(r"(?i)\b(bearer|basic|token)(\s+|=|:\s*)[^\s'\",}]+")


class Client:
    """JSON over HTTP to one server: every failure is one sentence naming the address.

    What a server can do to kvreplay is bounded: no redirect is followed (the API key
    would go where it points), one answer is read up to a size (:data:`MAX_ANSWER`,
    :func:`answer_limit`), a request and the reading of its answer end together at
    ``timeout`` seconds (a server that trickles its answer is cut off then), and no text
    a server sends is shown or recorded with the key, or another secret, in it."""

    def __init__(self, url: str, timeout: float, api_key: str | None) -> None:
        self.address = parse_address(url)
        self.url = self.address.url
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        self._secret = api_key or None
        self.secrets = Secrets.of(api_key)
        if api_key:
            if not (api_key.isascii() and api_key.isprintable()) or " " in api_key:
                raise KvreplayError(
                    "The API key (--api-key-env) holds characters an HTTP header cannot carry."
                )
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(
        self, method: str, path: str, body: Any = None, limit: int = MAX_ANSWER
    ) -> tuple[int, Answer]:
        """(status, the answer; its value None when it is not JSON); a connection failure,
        a timeout, a redirect or an answer too large raises."""
        status, raw = self._exchange(method, path, body, limit)
        value, _ = _parsed(raw)
        return status, Answer(value, self._where(method, path), secrets=self.secrets)

    def text(self, path: str, limit: int = MAX_ANSWER) -> tuple[int, str]:
        """(status, the body as text) of a GET whose answer is not JSON (``/metrics``)."""
        status, raw = self._exchange("GET", path, None, limit)
        return status, raw.decode("utf-8", "replace")

    def with_timeout(self, timeout: float) -> Client:
        """The same server and key, each request bounded by ``timeout`` seconds."""
        return Client(self.url, timeout, self._secret)

    def ok(self, method: str, path: str, body: Any = None, limit: int = MAX_ANSWER) -> Answer:
        """The answer of a request that must succeed with JSON."""
        status, raw = self._exchange(method, path, body, limit)
        value, problem = _parsed(raw)
        where = self._where(method, path)
        if status != 200:
            detail = value.get("error", value) if isinstance(value, dict) else value
            text = self.quoted(raw.decode("utf-8", "replace") if problem else detail) if raw else ""
            raise KvreplayError(f"{where} with HTTP {status}{f' ({text})' if text else ''}.")
        if problem:
            raise KvreplayError(f"{where} with something that is not JSON ({problem}).")
        return Answer(value, where, secrets=self.secrets)

    def quoted(self, detail: Any) -> str:
        """Text from a server as a sentence may show it: the key and anything in the
        form of a credential redacted, on one line, at most 200 characters."""
        text = self.secrets.redact(detail if isinstance(detail, str) else json.dumps(detail))
        text = SECRET_FORMS.sub(lambda m: f"{m.group(1)}{m.group(2)}[redacted]", text)
        text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
        return text if len(text) <= 200 else text[:197] + "..."

    def _where(self, method: str, path: str) -> str:
        return f"The server at {self.url} answered {method} {path}"

    def _exchange(self, method: str, path: str, body: Any, limit: int) -> tuple[int, bytes]:
        """(status, body) of one request, within ``timeout`` from connecting to the last
        byte: a watchdog shuts the socket at the deadline, which ends any read."""
        data = None if body is None else json.dumps(body).encode()
        kind = http.client.HTTPSConnection if self.address.https else http.client.HTTPConnection
        connection = kind(self.address.host, self.address.port, timeout=self.timeout)
        expired = threading.Event()
        sockets: list[socket.socket] = []  # the response reads it after the connection lets go

        def cut() -> None:
            expired.set()
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout, cut)
        watchdog.daemon = True
        watchdog.start()
        raw = b""
        try:
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            connection.request(method, self.address.base + path, body=data, headers=self.headers)
            response = connection.getresponse()
            status = response.status
            if not 300 <= status < 400:
                raw = read_bounded(response, limit)
        except TooLarge:
            raise KvreplayError(
                f"The server at {self.url} answered {method} {path} with more than "
                f"{limit / 2**20:.1f} MB, more than kvreplay reads of one answer."
            ) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if expired.is_set():
                raise self._late(method, path) from None
            reason = self.quoted(str(getattr(exc, "reason", "")) or first_line(exc))
            raise KvreplayError(
                f"The server at {self.url} did not answer {method} {path} ({reason})."
            ) from None
        finally:
            watchdog.cancel()
            connection.close()
        if expired.is_set():  # the body ended because the deadline cut it
            raise self._late(method, path)
        if 300 <= status < 400:
            raise KvreplayError(
                f"The server at {self.url} answered {method} {path} with a redirect (HTTP "
                f"{status}); kvreplay follows none, so give --url the address that answers."
            )
        return status, raw

    def _late(self, method: str, path: str) -> KvreplayError:
        return KvreplayError(
            f"The server at {self.url} did not answer {method} {path} within "
            f"{self.timeout:g} seconds (--timeout)."
        )


PROMETHEUS_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
PROMETHEUS_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus text exposition (``/metrics``) as each metric's samples (labels,
    value); lines that are not a well-formed sample are skipped."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = PROMETHEUS_SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(PROMETHEUS_LABEL.findall(match.group(2) or ""))
        samples.setdefault(match.group(1), []).append((labels, value))
    return samples


def metric_sums(text: str, names: dict[str, str]) -> dict[str, float]:
    """Each wanted metric (Prometheus name -> kvreplay's name) summed over its samples,
    for the metrics the server reports."""
    samples = prometheus(text)
    return {
        ours: sum(value for _, value in samples[theirs])
        for theirs, ours in names.items()
        if theirs in samples
    }


def _parsed(raw: bytes) -> tuple[Any, str | None]:
    """A body as strict JSON (see :mod:`kvreplay.core.jsonio`), or None and why it is not;
    an empty body is None (vLLM's reset answers with none)."""
    if not raw:
        return None, None
    try:
        return parse_json(raw), None
    except JsonError as exc:
        return None, str(exc)


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
    salts: ClassVar[bool]  # a request's cache_salt keeps its cached blocks apart
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

    def load(self) -> dict[str, float]:
        """What the server reports in flight now (:data:`kvreplay.backends.traffic.Sample`)."""
        ...

    def logprobs_mode(self) -> str | None:
        """Which log-probability of a sampled token the server reports (None: it does
        not say, or reports none: no rollout stack)."""
        ...

    def sample(
        self, model: str, prompt: Sequence[int], sampling: Sampling, eos: Sequence[int]
    ) -> Sampled:
        """A rollout's turn: each sampled token with its log-probability (or a refusal)."""
        ...

    def prompt_logprobs(self, model: str, ids: Sequence[int]) -> list[list[tuple[int, float]]]:
        """Its own prefill's log-probabilities at each position after the first (or a
        refusal: a server that reports none cannot score)."""
        ...

    def reload_weights(self, folder: str) -> None:
        """Reload its weights in place from a folder (or refuse in a sentence)."""

    def traffic_slot(self, client: int) -> int:
        """The slot a traffic client's requests go to: never the arm's or a companion's."""
        ...

    def pool_tokens(self) -> int | None:
        """Tokens the server's K/V pool holds for requests (None: it does not say, or its
        slots keep their K/V apart)."""
        ...

    def eviction_tokens(self, computed: int) -> int:
        """Tokens of unrelated prompts, sent on the arm's slot after it wrote P's
        ``computed`` tokens, that overwrite part of them."""
        ...
