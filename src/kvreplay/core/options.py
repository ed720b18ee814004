"""Options declared once (design: every option declared once).

A setting a user can give is a dataclass field whose metadata (:func:`option`) names its
command-line flag, its help and the values it takes. The command line builds its options
from those fields, the docs' option tables are generated from them, a request is built
back from the parsed values (:func:`build`), and a command that reproduces a request is
spelled from it (:func:`arguments`): the flag, the help and the default are each stated
once, in the field. Backends' settings, experiments' own options, the shared run options,
where units run, and a check's expectation are all declared this way.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from kvreplay.core.errors import KvreplayError

SEEDS = (0, 2**63 - 1)  # a seed's bounds: torch's and the sampler's generators take these
COUNTS = (1, 10_000_000)  # a count of items or rows: far past any run a machine completes


def bounds(pair: tuple[float, float]) -> dict[str, float]:
    """Shared bounds as an option's ``minimum`` and ``maximum``."""
    return {"minimum": pair[0], "maximum": pair[1]}


@dataclass(frozen=True)
class Option:
    """How a field appears on the command line.

    ``flag`` and ``help`` as ``--help`` shows them; ``choices`` list the values a text
    takes, and ``minimum`` and ``maximum`` bound a number (design: option bounds: every
    integer and float option declares both, and they are checked before anything runs,
    on the command line and on a request built in Python, :func:`check_bounds`);
    ``negative`` names the flag that sets a tri-state switch off (``--no-chat``);
    ``parse`` turns the text given into the field's value (``--dtypes bf16,fp32``) and
    ``spell`` turns a value back into text; ``elsewhere`` says why a backend that does not
    take the setting refuses it; ``output`` marks a path the command writes and says what
    it names (``file`` or ``folder``): the command line makes it an
    :class:`~kvreplay.report.commands.OutputPath`, which the output writer checks before any
    work (design: output writer).
    """

    flag: str
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    negative: str | None = None
    parse: Callable[[Any], Any] | None = None
    spell: Callable[[Any], str] | None = None
    elsewhere: str = ""
    output: str = ""


def option(flag: str, help: str, **details: Any) -> dict[str, Option]:
    """A field's metadata: ``field(default=..., metadata=option("--flag", "help"))``."""
    return {"option": Option(flag, help, **details)}


@dataclass(frozen=True)
class Declared:
    """One option as its field declares it: the field's name (the keyword a request is
    built with), its :class:`Option`, the type it holds (``int``, ``float``, ``str``,
    ``bool``, ``path``, optionally ``| None``, or ``parsed``: what its ``parse`` makes)
    and its default (``None`` where the field has none)."""

    name: str
    option: Option
    kind: str
    optional: bool
    default: Any

    @property
    def flag(self) -> str:
        return self.option.flag

    def text(self, value: Any) -> str:
        """A value as the command line spells it."""
        if self.option.spell is not None:
            return self.option.spell(value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    def words(self, value: Any) -> list[str]:
        """The words that give ``value`` on a command line (none for the default)."""
        if value == self.default:
            return []
        if self.kind == "path" and value is not None:
            return [self.flag, str(value)]
        if self.kind == "bool":
            if value is None:
                return []
            return [self.flag] if value else [self.option.negative] if self.option.negative else []
        return [] if value is None else [self.flag, self.text(value)]


def _kind(hint: Any) -> tuple[str, bool]:
    """The base type name of an annotation and whether it admits None."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    name = getattr(hint, "__name__", str(hint))
    if name == "Path":
        return "path", optional
    return (name if name in ("int", "float", "str", "bool") else "parsed"), optional


def _reading_order(cls: type) -> list[dataclasses.Field[Any]]:
    """A dataclass's fields, those it declares itself first, then its bases' (a request
    reads before the settings it inherits)."""
    by_name = {f.name: f for f in fields(cls)}
    ordered = [
        by_name[name]
        for klass in cls.__mro__
        for name in vars(klass).get("__annotations__", {})
        if name in by_name
    ]
    return list({f.name: f for f in ordered}.values())


def declared(cls: type) -> dict[str, Declared]:
    """Every option ``cls`` declares (itself, then its bases), by field name."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in _reading_order(cls):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        kind, optional = _kind(hints[f.name])
        default = f.default
        if default is dataclasses.MISSING:
            factory = f.default_factory
            default = None if factory is dataclasses.MISSING else factory()
        found[f.name] = Declared(f.name, spec, kind, optional, default)
    return found


def nested(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that hold a dataclass of declared options (a request's
    sampler, its placement), by name: their options are the request's too."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in fields(cls)
        if isinstance(hints[f.name], type) and is_dataclass(hints[f.name])
        and any("option" in g.metadata for g in fields(hints[f.name]))
    }  # fmt: skip


def every(cls: type) -> Iterator[Declared]:
    """Every option of ``cls`` and of the dataclasses it holds, outermost first."""
    yield from declared(cls).values()
    for inner in nested(cls).values():
        yield from every(inner)


def build(cls: type, values: Mapping[str, Any], **given: Any) -> Any:
    """``cls`` made from option values by field name (those not given keep the field's
    default), its nested option dataclasses made the same way; ``given`` supplies the
    fields that are not options (a run's folder, its backend). Every number is checked
    against its declared bounds (:func:`check_bounds`)."""
    kwargs = dict(given)
    for name, inner in nested(cls).items():
        if name not in kwargs:
            kwargs[name] = build(inner, values)
    for name in declared(cls):
        if name in values and values[name] is not None and name not in kwargs:
            kwargs[name] = values[name]
    return check_bounds(cls(**kwargs))


def bounds_problem(spec: Declared, value: Any) -> str | None:
    """Why ``value`` is not a number ``spec`` takes (outside its declared bounds, not a
    number of its kind, or not finite), or None (a value that is not a number's kind is
    its field's own check)."""
    if value is None or spec.kind not in ("int", "float"):
        return None
    low, high = spec.option.minimum, spec.option.maximum
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (spec.kind == "int" and not isinstance(value, int)):
        return f"{spec.flag} must be {'an integer' if spec.kind == 'int' else 'a number'}"
    if (
        not math.isfinite(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        shown = repr(value) if isinstance(value, float) else str(value)
        return f"{spec.flag} must lie between {low:g} and {high:g}; got {shown[:40]}"
    return None


def check_bounds(instance: Any) -> Any:
    """Refuse (one sentence) a number of ``instance``'s options, or of the option
    dataclasses it holds, outside its declared bounds; return ``instance``."""
    for name, spec in declared(type(instance)).items():
        problem = bounds_problem(spec, getattr(instance, name))
        if problem is not None:
            raise KvreplayError(problem + ".")
    for name in nested(type(instance)):
        check_bounds(getattr(instance, name))
    return instance


def arguments(instance: Any) -> list[str]:
    """The command-line words that give ``instance``'s options where they differ from
    their defaults, nested option dataclasses included (what a repro pack prints)."""
    words: list[str] = []
    for name, spec in declared(type(instance)).items():
        words += spec.words(getattr(instance, name))
    for name in nested(type(instance)):
        words += arguments(getattr(instance, name))
    return words
