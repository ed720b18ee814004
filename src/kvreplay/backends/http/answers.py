"""A server's JSON answer, read field by field (design: server adapter).

A server's answer is input like any other: an adapter reads each field it needs through
:class:`Answer`, which checks the field's type and range as it is read, so that a
malformed or hostile answer ends in one sentence naming the server, the request and the
field, never in a traceback or in a row. Strings a server says about itself are bounded
(:data:`MAX_TEXT`) because they go into the run's contract and the probe's table, and
none may hold the API key or another secret (:mod:`kvreplay.backends.http.secrets`): a server
that echoes one is refused in a sentence that does not repeat it.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from kvreplay.backends.http.secrets import Secrets
from kvreplay.core.errors import KvreplayError

MAX_TEXT = 256  # characters of a name, version or setting a server reports (recorded)
MAX_COUNT = 2**31  # a count a server reports (context length, block size, slots)
NO_SECRETS = Secrets()
HOLDS_SECRET = (
    "holds the API key (--api-key-env) or another secret, which kvreplay never shows or records"
)


def shown(value: Any) -> str:
    """A value as a refusal quotes it: its repr, at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Answer:
    """One JSON value of an answer, with where it came from (``where``: the server and
    the request; ``path``: the field, e.g. ``choices[0].token_ids[3]``; ``secrets``: what
    no field may hold)."""

    def __init__(self, value: Any, where: str, path: str = "", secrets: Secrets = NO_SECRETS):
        self.value, self.where, self.path, self.secrets = value, where, path, secrets

    def refuse(self, problem: str) -> NoReturn:
        """One sentence naming the field; a value or field name that holds a secret is
        not quoted."""
        path = self.path or "answer"
        if self.secrets.holds(path):
            path = "a field whose name"
        if self.secrets.holds(problem):
            problem = HOLDS_SECRET
        raise KvreplayError(f"{self.where}, but its {path} {problem}.")

    def _child(self, key: str | int) -> Answer:
        path = f"{self.path}[{key}]" if isinstance(key, int) else f"{self.path}.{key}".lstrip(".")
        return Answer(self.value[key], self.where, path, self.secrets)

    def _object(self) -> dict[str, Any]:
        if not isinstance(self.value, dict):
            self.refuse(f"is {shown(self.value)}, not a JSON object")
        return self.value

    def has(self, key: str) -> bool:
        """Whether this is an object holding ``key`` (null or not): never refuses."""
        return isinstance(self.value, dict) and key in self.value

    def __getitem__(self, key: str) -> Answer:
        """A field the answer must hold."""
        if key not in self._object():
            self.refuse(f"lacks {key}")
        return self._child(key)

    def get(self, key: str) -> Answer | None:
        """A field the answer may leave out or set to null."""
        return self._child(key) if self._object().get(key) is not None else None

    def items(self) -> list[tuple[str, Answer]]:
        return [(key, self._child(key)) for key in self._object()]

    def list(self) -> list[Answer]:
        if not isinstance(self.value, list):
            self.refuse(f"is {shown(self.value)}, not a list")
        return [self._child(i) for i in range(len(self.value))]

    def integer(self, low: int = 0, high: int | None = None) -> int:
        """An integer in [low, high] (a bool or a float is not one)."""
        value = self.value
        if not isinstance(value, int) or isinstance(value, bool):
            self.refuse(f"is {shown(value)}, not an integer")
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"at least {low}"
            self.refuse(f"is {value}, not {bound}")
        return value

    def number(self) -> float:
        """A finite number."""
        value = self.value
        if not isinstance(value, int | float) or isinstance(value, bool):
            self.refuse(f"is {shown(value)}, not a number")
        if not math.isfinite(value):
            self.refuse(f"is {value}, not a finite number")
        return float(value)

    def text(self, limit: int | None = MAX_TEXT) -> str:
        """A string of printable characters, at most ``limit`` of them, that holds no
        secret (None: any text, for text that only goes back to the server)."""
        value = self.value
        if not isinstance(value, str):
            self.refuse(f"is {shown(value)}, not a string")
        if limit is not None and len(value) > limit:
            self.refuse(f"is {len(value)} characters long (at most {limit})")
        if limit is not None and not value.isprintable():
            self.refuse(f"is {shown(value)}, which holds control characters")
        if limit is not None and self.secrets.holds(value):
            self.refuse(HOLDS_SECRET)
        return value

    def scalar(self) -> None | bool | int | float | str:
        """A setting as a run records it: null, a bool, an integer, a finite number or a
        short string."""
        value = self.value
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if self.secrets.holds(str(value)):
                self.refuse(HOLDS_SECRET)
            return value
        if isinstance(value, float):
            return self.number()
        if isinstance(value, str):
            return self.text()
        return self.refuse(f"is {shown(value)}, not a number, string or flag")
