"""How a fault goes on and comes off: a list of patches, each replacing one attribute
of an engine's own class or module by a wrapper of the original."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Patch = tuple[Any, str, Callable[[Any], Any]]
"""(owner, attribute, make): ``make(original)`` returns the replacement."""


def install(patches: list[Patch]) -> Callable[[], None]:
    """Apply the patches; return what takes them off again, in reverse order."""
    applied = []
    for owner, attribute, make in patches:
        original = getattr(owner, attribute)
        setattr(owner, attribute, make(original))
        applied.append((owner, attribute, original))

    def uninstall() -> None:
        for owner, attribute, original in reversed(applied):
            setattr(owner, attribute, original)

    return uninstall
