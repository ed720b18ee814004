"""Backends: the registry of inference stacks (design: backend, backend protocol).

Each backend is one module with one class implementing :class:`~kvreplay.backends.base.Backend`
(its settings, capabilities, contract, model checks, served model), registered here by
name with one line. A package can add its own through the ``kvreplay.backends`` entry
point group (``name = "module:Class"``) without touching kvreplay. Classes are imported
when first asked for, so naming the backends loads no inference library.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Any

from kvreplay.backends.base import Backend, Capabilities
from kvreplay.core.errors import KvreplayError

BUILTIN: dict[str, str] = {
    "hf": "kvreplay.backends.hf:HfBackend",
    "vllm": "kvreplay.backends.vllm:VllmBackend",
    "http": "kvreplay.backends.http:HttpBackend",
    "llamacpp": "kvreplay.backends.llamacpp:LlamaCppBackend",
}


def registry() -> dict[str, str]:
    """Every backend by name: the built-in ones, then those packages register."""
    found = dict(BUILTIN)
    for name, where in _registered():
        found.setdefault(name, where)
    return found


@functools.cache
def _registered() -> tuple[tuple[str, str], ...]:
    """The backends installed packages register, read once per process: finding them
    reads every installed distribution's metadata (about 6 ms), and an audit or an
    analysis names a backend for every row it reads."""
    return tuple((entry.name, entry.value) for entry in entry_points(group="kvreplay.backends"))


def load(where: str) -> Any:
    """What a registry line names (``module:attribute``), imported now."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


def backend_class(name: str) -> type[Backend]:
    where = registry().get(name)
    if where is None:
        raise KvreplayError(f"Unknown backend {name!r}; choose {', '.join(registry())}.")
    return load(where)


def make_backend(name: str = "hf", **settings: Any) -> Backend:
    """A backend with its settings; a setting it does not take is refused by its flag."""
    cls = backend_class(name)
    own = cls.settings()
    for key in settings:
        if key not in own:
            flag = "--" + key.replace("_", "-")
            why = setting_options().get(key, {}).get("elsewhere")
            raise KvreplayError(
                f"{flag} does not apply to the {name} backend{f': {why}' if why else ''}."
            )
    return cls(**settings)


def backend_from_contract(
    data: dict[str, Any] | None, connection: dict[str, Any] | None = None
) -> Backend:
    """The backend a contract recorded (an hf contract records none), reached through the
    connection settings given (those the backend takes; the rest are ignored)."""
    cls = backend_class("hf" if data is None else data["name"])
    given = {k: v for k, v in (connection or {}).items() if k in cls.connection and v is not None}
    return cls() if data is None else cls.from_contract(data, given)


def precisions() -> tuple[str, ...]:
    """Every precision some registered backend runs, in registry order."""
    found: dict[str, None] = {}
    for name in registry():
        found |= dict.fromkeys(backend_class(name).precisions)
    return tuple(found)


def setting_options(connection_only: bool = False) -> dict[str, dict[str, Any]]:
    """Every registered backend's CLI settings (or only its connection settings): field
    name -> option, help, type, default, and the backends that take it."""
    options: dict[str, dict[str, Any]] = {}
    for name in registry():
        cls = backend_class(name)
        for key, meta in cls.settings().items():
            if connection_only and key not in cls.connection:
                continue
            entry = options.setdefault(key, {**meta, "backends": []})
            entry["backends"].append(name)
    return options


__all__ = [
    "Backend",
    "Capabilities",
    "backend_class",
    "backend_from_contract",
    "load",
    "make_backend",
    "precisions",
    "registry",
    "setting_options",
]
