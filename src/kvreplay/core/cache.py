"""A process-wide cache that keeps only the entries used last: what a long-lived process
(a library user's, a test session) opens or computes once per key, without holding every
key it ever met (a loaded scorer model, a model's digest)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most ``size`` entries; asked for one more, it forgets the one used longest ago."""

    def __init__(self, size: int) -> None:
        assert size >= 1
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key``, made (once while it is kept) by ``make``."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = make()
        self._entries[key] = value
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
