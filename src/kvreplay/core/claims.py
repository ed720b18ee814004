"""Typed claims (design: typed claims): a section's claims are a dataclass, as rows are,
written to claims.json by one encoder (:func:`encode`) and read back by one decoder
(:func:`decode`), so the report, the summary, the headline and a check read fields, and a
renamed key fails a type check, not a report.

A field's JSON key is its name unless its metadata (:func:`key`) says otherwise:

- ``name``: the key, a template formatted with the context (``"{left}_correct"``);
- ``context``: values for the templates of the fields below this one (the matched
  matrix's left arm is ``live``, fixed-prefix's ``incremental``);
- ``extra``: the value is written under claims.json's ``extra``, at the path this field
  has (claims.json keeps what the paper's schema does not name there);
- ``flatten``: a mapping's entries (or a dataclass's keys) are merged into the object
  that holds the field, each key after ``prefix``; without a prefix the entries are the
  keys no other field of that object takes (a matrix section's precisions);
- ``omit``: a None value leaves the key out (a served ledger has no cache columns).

Plain data only: str, int, float, bool, None, lists, tuples, mappings with string keys
and dataclasses of those. No numpy value reaches claims.json.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from kvreplay.core.errors import KvreplayError

Json = dict[str, Any]
T = TypeVar("T")
ROOT_EXTRA = "extra"


@dataclass(frozen=True)
class Key:
    """How one field is written (see the module's docstring)."""

    name: str | None = None
    extra: bool = False
    flatten: bool = False
    prefix: str = ""
    omit: bool = False
    context: Mapping[str, str] = field(default_factory=dict)

    def json_key(self, name: str, context: Mapping[str, str]) -> str:
        return (self.name or name).format(**context)


def key(
    name: str | None = None,
    *,
    extra: bool = False,
    flatten: bool = False,
    prefix: str = "",
    omit: bool = False,
    context: Mapping[str, str] | None = None,
) -> dict[str, Key]:
    """A field's metadata: ``field(metadata=key("{left}_correct"))``."""
    return {"claims": Key(name, extra, flatten, prefix, omit, dict(context or {}))}


def _spec(f: dataclasses.Field[Any]) -> Key:
    return f.metadata.get("claims", _PLAIN)


_PLAIN = Key()


class ClaimsError(KvreplayError, ValueError):
    """claims.json does not hold what a section's claims type declares; the message
    names the key."""


# -- encoding ------------------------------------------------------------------------


def encode(value: Any, context: Mapping[str, str] | None = None) -> Json:
    """A section's claims as the part of claims.json it writes (its ``extra`` part under
    ``extra``)."""
    main, extra = _encode(value, dict(context or {}))
    assert isinstance(main, dict), f"{type(value).__name__} is not a claims dataclass"
    return {**main, ROOT_EXTRA: extra} if extra else main


def _encode(value: Any, context: Mapping[str, str]) -> tuple[Any, Json | None]:
    """(what a value writes where it stands, what it writes under ``extra`` there)."""
    if is_dataclass(value) and not isinstance(value, type):
        return _encode_fields(value, context)
    if isinstance(value, Mapping):
        main, extra = {}, {}
        for name, item in value.items():
            assert isinstance(name, str), f"claims keys are text, not {name!r}"
            main[name], extra_item = _encode(item, context)
            if extra_item:
                extra[name] = extra_item
        return main, extra or None
    if isinstance(value, list | tuple):
        items = [_encode(item, context) for item in value]
        assert not any(extra for _, extra in items), "a list holds no extra claims"
        return [main for main, _ in items], None
    assert value is None or isinstance(value, str | int | float), f"{value!r} is not JSON"
    assert type(value) in (str, int, float, bool, type(None)), f"{value!r}: a plain value"
    return value, None


def _encode_fields(value: Any, context: Mapping[str, str]) -> tuple[Json, Json | None]:
    main: Json = {}
    extra: Json = {}
    for f in fields(value):
        spec, item = _spec(f), getattr(value, f.name)
        if item is None and spec.omit:
            continue
        written, written_extra = _encode(item, {**context, **spec.context})
        target = extra if spec.extra else main
        assert not (spec.extra and written_extra), f"{f.name}: extra inside extra"
        if spec.flatten:
            assert isinstance(written, dict), f"{f.name}: only a mapping or dataclass flattens"
            _merge(target, {spec.prefix + k: v for k, v in written.items()}, f.name)
            _merge(extra, {spec.prefix + k: v for k, v in (written_extra or {}).items()}, f.name)
            continue
        name = spec.json_key(f.name, context)
        _merge(target, {name: written}, f.name)
        if written_extra:
            _merge(extra, {name: written_extra}, f.name)
    return main, extra or None


def _merge(target: Json, items: Json, field_name: str) -> None:
    taken = target.keys() & items.keys()
    assert not taken, f"{field_name} writes {sorted(taken)} a second time"
    target.update(items)


# -- decoding ------------------------------------------------------------------------


def decode(cls: type[T], data: Json, context: Mapping[str, str] | None = None) -> T | None:
    """A section's claims from claims.json (its ``extra`` read from under ``extra``), or
    None when claims.json holds none of its keys; what it holds otherwise must be what
    ``cls`` declares (:class:`ClaimsError`, naming the key)."""
    main = {k: v for k, v in data.items() if k != ROOT_EXTRA}
    extra = data.get(ROOT_EXTRA) or {}
    if not isinstance(extra, dict):
        raise ClaimsError(f"claims.json: {ROOT_EXTRA} is not an object.")
    context = dict(context or {})
    if not _present(cls, main, extra, context):
        return None
    return typing.cast(T, _decode_fields(cls, main, extra, context, ""))


def _present(cls: type, main: Json, extra: Json, context: Mapping[str, str]) -> bool:
    """Whether claims.json holds any key of a section's claims type."""
    for f in fields(cls):
        spec = _spec(f)
        source = extra if spec.extra else main
        assert not spec.flatten or spec.prefix, f"{f.name}: a section flattens with a prefix"
        if spec.flatten and any(k.startswith(spec.prefix) for k in source):
            return True
        if not spec.flatten and spec.json_key(f.name, context) in source:
            return True
    return False


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode_fields(cls: type, data: Any, extra: Any, context: Mapping[str, str], path: str) -> Any:
    if not isinstance(data, dict):
        raise ClaimsError(f"claims.json: {path or 'the claims'} is not an object.")
    extra = extra if isinstance(extra, dict) else {}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    taken = _taken(cls, context)
    for f in fields(cls):
        spec, hint = _spec(f), hints[f.name]
        inner = {**context, **spec.context}
        source = extra if spec.extra else data
        mirror = None if spec.extra else extra
        if spec.flatten:
            values[f.name] = _flattened(hint, spec, source, mirror, taken, inner, path)
            continue
        name = spec.json_key(f.name, context)
        where = f"{path}.{name}" if path else name
        if name in source:
            item_extra = mirror.get(name) if mirror else None
            values[f.name] = _decode(hint, source[name], item_extra, inner, where)
        elif _optional(hint):
            values[f.name] = None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ClaimsError(f"claims.json: {where} is missing.")
    return cls(**values)


def _taken(cls: type, context: Mapping[str, str]) -> set[str]:
    """The keys the fields of ``cls`` take where they stand (those a flattened mapping
    without a prefix leaves to the others)."""
    taken: set[str] = set()
    for f in fields(cls):
        spec = _spec(f)
        if spec.flatten:
            hint = _base(_hints(cls)[f.name])
            if is_dataclass(hint):
                taken |= _taken(typing.cast(type, hint), {**context, **spec.context})
        elif not spec.extra:
            taken.add(spec.json_key(f.name, context))
    return taken


def _flattened(
    hint: Any,
    spec: Key,
    source: Json,
    mirror: Json | None,
    taken: set[str],
    context: Mapping[str, str],
    path: str,
) -> Any:
    """A flattened field: a dataclass read from the object itself, or a mapping of the
    keys with its prefix (without one, of the keys no other field takes)."""
    base = _base(hint)
    if is_dataclass(base):
        present = _present(typing.cast(type, base), source, {}, context)
        if not present and _optional(hint):
            return None
        return _decode_fields(typing.cast(type, base), source, mirror, context, path)
    (item_hint,) = typing.get_args(base)[1:]
    entries = {
        k.removeprefix(spec.prefix): v
        for k, v in source.items()
        if (k.startswith(spec.prefix) if spec.prefix else k not in taken)
    }
    mirror = mirror or {}
    return {
        name: _decode(
            item_hint,
            value,
            mirror.get(spec.prefix + name),
            context,
            f"{path}.{spec.prefix}{name}" if path else spec.prefix + name,
        )
        for name, value in entries.items()
    }


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _base(hint: Any) -> Any:
    """``X`` of ``X | None``."""
    if _optional(hint):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def _decode(hint: Any, value: Any, extra: Any, context: Mapping[str, str], path: str) -> Any:
    if value is None and (_optional(hint) or hint is Any):
        return None
    hint = _base(hint)
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if is_dataclass(hint):
        return _decode_fields(typing.cast(type, hint), value, extra, context, path)
    if origin in (dict, Mapping) or (origin is None and hint is dict):
        _expect(isinstance(value, dict), path, "an object")
        args = typing.get_args(hint)
        item = args[1] if args else Any
        extra = extra if isinstance(extra, dict) else {}
        return {k: _decode(item, v, extra.get(k), context, f"{path}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        _expect(isinstance(value, list), path, "a list")
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            _expect(len(value) == len(args), path, f"a list of {len(args)}")
            return tuple(
                _decode(a, v, None, context, f"{path}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item = args[0] if args else Any
        items = [_decode(item, v, None, context, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return _plain(hint, value, path)


def _plain(hint: Any, value: Any, path: str) -> Any:
    if hint is float:
        _expect(isinstance(value, int | float) and not isinstance(value, bool), path, "a number")
        return float(value)
    if hint is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), path, "an integer")
        return value
    if hint is bool:
        _expect(isinstance(value, bool), path, "true or false")
        return value
    if hint is str:
        _expect(isinstance(value, str), path, "text")
        return value
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        for option in typing.get_args(hint):
            try:
                return _decode(option, value, None, {}, path)
            except ClaimsError:
                continue
        raise ClaimsError(f"claims.json: {path} is none of {hint}.")
    raise AssertionError(f"{path}: claims hold no {hint}")


def _expect(ok: bool, path: str, what: str) -> None:
    if not ok:
        raise ClaimsError(f"claims.json: {path} is not {what}.")
