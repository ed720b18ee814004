"""Backends: the registry of inference stacks (design: backend, backend protocol).

Each backend is one module with one class implementing :class:`~kvreplay.backends.base.Backend`
(its settings, capabilities, contract, model checks, served model), registered here by
name with one line. A package can add its own through the ``kvreplay.backends`` entry
point group (``name = "module:Class"``) without touching kvreplay. Classes are imported
when the registry is first asked (each imports its inference library only when it runs),
and a class states its own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreplay.backends.base import Backend, Capabilities, ModelRef
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import Declared
from kvreplay.core.registry import Registry, located

# Every built-in backend's class, one line each; installed packages add theirs through the
# ``kvreplay.backends`` entry point group.
BUILTIN: tuple[str, ...] = (
    "kvreplay.backends.hf:HfBackend",
    "kvreplay.backends.vllm:VllmBackend",
    "kvreplay.backends.http:HttpBackend",
    "kvreplay.backends.llamacpp:LlamaCppBackend",
)
BACKENDS: Registry[type[Backend]] = Registry("backend", located(BUILTIN, "kvreplay.backends"))


def registry() -> list[str]:
    """Every backend's name: the built-in ones, then those packages register."""
    return BACKENDS.names()


def backend_class(name: str) -> type[Backend]:
    return BACKENDS.get(name)


DEFAULT_BACKEND = "hf"


def make_backend(name: str = DEFAULT_BACKEND, **settings: Any) -> Backend:
    """A backend with its settings; a setting it does not take is refused by its flag."""
    cls = backend_class(name)
    own = cls.settings()
    for key in settings:
        if key not in own:
            known = setting_options().get(key)
            flag = known.declared.flag if known else "--" + key.replace("_", "-")
            why = known.declared.option.elsewhere if known else ""
            raise KvreplayError(
                f"{flag} does not apply to the {name} backend{f': {why}' if why else ''}."
            )
    return cls(**settings)


def backend_from_contract(
    data: dict[str, Any], connection: dict[str, Any] | None = None
) -> Backend:
    """The backend a contract recorded (as :func:`kvreplay.contract.upgrade.current` reads
    it: every contract names one), reached through the connection settings given (those
    the backend takes; the rest are ignored)."""
    cls = backend_class(data["name"])
    given = {k: v for k, v in (connection or {}).items() if k in cls.connection and v is not None}
    return cls.from_contract(data, given)


def precisions() -> tuple[str, ...]:
    """Every precision some registered backend runs, in registry order."""
    found: dict[str, None] = {}
    for name in registry():
        found |= dict.fromkeys(backend_class(name).precisions)
    return tuple(found)


@dataclass(frozen=True)
class Setting:
    """One backend setting as the command line offers it: its declaration (the first
    backend's to declare it) and every backend that takes it."""

    declared: Declared
    backends: tuple[str, ...]


def setting_options(connection_only: bool = False) -> dict[str, Setting]:
    """Every registered backend's CLI settings (or only its connection settings), by
    field name; a setting several backends take (``--companions``) is offered once."""
    found: dict[str, Setting] = {}
    for name in registry():
        cls = backend_class(name)
        for key, spec in cls.settings().items():
            if connection_only and key not in cls.connection:
                continue
            known = found.get(key)
            found[key] = Setting(
                known.declared if known else spec, (*(known.backends if known else ()), name)
            )
    return found


__all__ = [
    "DEFAULT_BACKEND",
    "Backend",
    "Capabilities",
    "ModelRef",
    "Setting",
    "backend_class",
    "backend_from_contract",
    "make_backend",
    "precisions",
    "registry",
    "setting_options",
]
