"""One registry for every kind of thing kvreplay looks up by name (design: registry):
backends, server adapters, experiments, tables and sections.

A registry is typed and lazy: what it holds is gathered when it is first asked (a
``module:attribute`` list is imported then, an installed package's entry points read
then), never at import, so that naming a kind loads nothing heavy. Each entry states its
own name (a class's ``name``, a declaration's ``name``): the registry never restates it.
Two entries with one name are refused, naming both, instead of one silently winning.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from kvreplay.core.errors import KvreplayError

T = TypeVar("T")


def load(where: str) -> Any:
    """What a ``module:attribute`` line names, imported now."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


@functools.cache
def installed_entries(group: str) -> tuple[str, ...]:
    """The ``module:attribute`` lines installed packages register in an entry point
    group, read once per process (reading every distribution's metadata takes a few ms)."""
    return tuple(entry.value for entry in entry_points(group=group))


Gathered = Iterable[tuple[str, T]]  # (where an entry comes from, the entry)


def located(builtin: Iterable[str], group: str | None = None) -> Callable[[], Gathered[Any]]:
    """The entries ``builtin`` lines name, then those installed packages add to
    ``group``, each imported when the registry is first asked."""
    lines = lambda: (*builtin, *(installed_entries(group) if group else ()))  # noqa: E731
    return lambda: ((where, load(where)) for where in lines())


class Registry(Generic[T]):
    """Entries of one kind (``what``: "backend", "experiment", ...) by name, in the order
    they were gathered; ``name_of`` reads an entry's own name."""

    def __init__(
        self,
        what: str,
        gather: Callable[[], Gathered[T]],
        name_of: Callable[[T], str] = lambda entry: entry.name,  # type: ignore[attr-defined]
    ) -> None:
        self.what, self._gather, self._name_of = what, gather, name_of

    @functools.cached_property
    def _entries(self) -> dict[str, T]:
        found: dict[str, T] = {}
        origins: dict[str, str] = {}
        for origin, entry in self._gather():
            name = self._name_of(entry)
            if name in found:
                raise KvreplayError(
                    f"Two {self.what}s are named {name!r} ({origins[name]} and {origin}); "
                    "uninstall or rename one."
                )
            found[name], origins[name] = entry, origin
        return found

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> T:
        """The entry named ``name``, or a refusal naming the choices."""
        entry = self._entries.get(name)
        if entry is None:
            raise KvreplayError(f"Unknown {self.what} {name!r}; choose {', '.join(self._entries)}.")
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def values(self) -> list[T]:
        return list(self._entries.values())

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())
