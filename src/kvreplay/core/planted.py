"""Which fault is planted in this process, if any (design: fault).

Set only where a fault is switched on (:func:`kvreplay.faults.planted`, vLLM's general
plugin in the process it plants into) and read where a run records it: a run's
manifest holds it in its one field :data:`FIELD`, a verdict and its JSON say it, a
resume or a reading of the run needs the same fault planted, and an audit refuses to
judge while one is. A field, never a substring: no text a run holds (a model path, an
item, a command line) can turn a fault on or make a run look like a planted one.
"""

from __future__ import annotations

FIELD = "planted_fault"
"""The manifest field that records the fault planted while the run ran."""

_planted: list[str] = []


def plant(name: str) -> None:
    """Record that the fault ``name`` is planted in this process from now on."""
    _planted.append(name)


def unplant(name: str) -> None:
    """Record that the fault ``name`` came off again."""
    _planted.remove(name)


def planted_fault() -> str | None:
    """The fault planted in this process (the innermost), or None."""
    return _planted[-1] if _planted else None
