"""Bounded background traffic on a server (design: traffic): the load an arm runs under.

A determinism check that starts a fresh server and asks one prompt at a time never sees
divergence that depends on what else the server was doing. ``--traffic N`` runs N
loopback clients for the duration of each arm that takes traffic, each sending other
items' prompts and random-token prompts of random lengths (seeded), short completions
on their own slots. Traffic is bounded in count (:data:`MAX_REQUESTS` per client) and in
time (:data:`MAX_SECONDS`, and each request's own timeout), and always stopped and
joined by the run, on an error or Ctrl-C too (a context manager).

What was in flight while the arm ran is recorded as a :class:`Load`: the clients' own
count of requests in flight, and what the server reports (running and waiting requests,
K/V cache usage, preemptions), polled while the arm runs. :func:`evict` is the other
use: unrelated prompts sent one after another until part of P's blocks are overwritten.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvreplay.core.errors import KvreplayError

MAX_CLIENTS = 16
"""Concurrent traffic clients at most: each is a thread and a server slot."""
MAX_REQUESTS = 256
"""Requests one client sends during one arm at most."""
MAX_SECONDS = 300.0
"""Seconds one arm's traffic runs at most, whatever the arm takes."""
REQUEST_SECONDS = 60.0
"""Seconds one traffic request may take (its client's timeout)."""
NEW_TOKENS = 16
"""Tokens a traffic request generates: short, so that stopping the traffic is quick."""
LENGTHS = (8, 256)
"""Random-token prompt lengths, drawn uniformly between these."""
POLL_SECONDS = 0.2
"""How often the server's load is read while an arm runs."""
MAX_EVICTION_REQUESTS = 64
"""Eviction requests per arm at most: on a pool larger than they fill, part of P survives
(the row says how much the hit read)."""

Send = Callable[[list[int], int], None]
"""Sends one prompt (token ids) on a client's slot and waits for its completion."""
Sample = Callable[[], dict[str, float]]
"""The server's load now: ``running``, ``waiting``, ``kv_cache_usage``, ``preemptions``
(those it reports)."""


def check_clients(clients: int) -> None:
    if isinstance(clients, bool) or not isinstance(clients, int) or not 0 <= clients <= MAX_CLIENTS:
        raise KvreplayError(f"--traffic must be from 0 to {MAX_CLIENTS} clients.")


@dataclass
class Load:
    """What was in flight while an arm ran: the traffic's clients and requests (sent,
    completed, failed; the most in flight at once, by the clients' own count) and the
    server's own report, polled (the most running and waiting requests, the highest K/V
    cache usage, the preemptions it counted meanwhile); None where it reports none."""

    clients: int
    sent: int = 0
    completed: int = 0
    failed: int = 0
    in_flight_max: int = 0
    polls: int = 0
    server_running_max: float | None = None
    server_waiting_max: float | None = None
    kv_cache_usage_max: float | None = None
    preemptions: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Load:
        return cls(**data)


def random_prompt(rng: random.Random, vocabulary: int) -> list[int]:
    return [rng.randrange(vocabulary) for _ in range(rng.randint(*LENGTHS))]


class Traffic:
    """N clients sending prompts until the ``with`` block ends (or their bounds); the
    block runs once the first traffic request is in flight. ``load`` is its record."""

    def __init__(
        self,
        send: Send,
        sample: Sample,
        clients: int,
        seed: str,
        prompts: Sequence[list[int]],
        vocabulary: int,
    ) -> None:
        self.send, self.sample = send, sample
        self.seed, self.prompts, self.vocabulary = seed, list(prompts), vocabulary
        self.load = Load(clients)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._first_preemptions: float | None = None
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ] + [threading.Thread(target=self._monitor, daemon=True)]

    def __enter__(self) -> Traffic:
        self._deadline = time.monotonic() + MAX_SECONDS
        for thread in self._threads:
            thread.start()
        self._started.wait(REQUEST_SECONDS)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._poll()

    def _prompt(self, rng: random.Random) -> list[int]:
        if self.prompts and rng.random() < 0.5:
            return list(rng.choice(self.prompts))
        return random_prompt(rng, self.vocabulary)

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.seed}:{index}")
        for _ in range(MAX_REQUESTS):
            if self._stop.is_set() or time.monotonic() > self._deadline:
                break
            prompt = self._prompt(rng)
            with self._lock:
                self._in_flight += 1
                self.load.sent += 1
                self.load.in_flight_max = max(self.load.in_flight_max, self._in_flight)
            self._started.set()
            try:
                self.send(prompt, index)
                ok = True
            except Exception:  # a refused or failed traffic request is counted, not raised
                ok = False
            with self._lock:
                self._in_flight -= 1
                self.load.completed += ok
                self.load.failed += not ok
        self._started.set()  # a client that sent nothing must not hold the arm back

    def _monitor(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._poll()

    def _poll(self) -> None:
        try:
            now = self.sample()
        except KvreplayError:
            return
        load = self.load
        with self._lock:
            load.polls += 1
            load.server_running_max = _max(load.server_running_max, now.get("running"))
            load.server_waiting_max = _max(load.server_waiting_max, now.get("waiting"))
            load.kv_cache_usage_max = _max(load.kv_cache_usage_max, now.get("kv_cache_usage"))
            if "preemptions" in now:
                if self._first_preemptions is None:
                    self._first_preemptions = now["preemptions"]
                load.preemptions = now["preemptions"] - self._first_preemptions


def _max(old: float | None, new: float | None) -> float | None:
    if new is None:
        return old
    return new if old is None else max(old, new)


def evict(send: Send, tokens: int, longest: int, seed: str, vocabulary: int) -> int:
    """Send unrelated random-token prompts one after another, ``tokens`` in all, each
    at most ``longest`` tokens, on the arm's slot (0): the prompts that overwrite part of
    P's cached blocks. Returns how many tokens were sent."""
    rng = random.Random(f"evict:{seed}")
    sent = 0
    for _ in range(MAX_EVICTION_REQUESTS):
        if sent >= tokens:
            break
        length = max(1, min(longest, tokens - sent))
        send([rng.randrange(vocabulary) for _ in range(length)], 0)
        sent += length
    return sent
