"""Strict JSON: the one reader for every JSON file and line kvreplay reads.

Standard JSON only. NaN and Infinity (spelled out, or a number such as ``1e400`` too
large for a float), lone surrogates (not UTF-8: they could never be written back),
integers too long to be an id or a count, nesting deeper than any item, plan or ledger
needs, and an object that names a key twice (a first-wins reader and a last-wins reader
would see two different values) are refused with a reason, so that whatever kvreplay
accepts it can also write back, hash and re-read exactly.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from itertools import compress
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import read_regular

MAX_DEPTH = 64
MAX_INT_DIGITS = 64


class JsonError(ValueError):
    """Input that is not strict JSON; the message is the reason, for a caller's sentence."""


def _constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


# A lone surrogate can only come from an escape in the text (UTF-8 cannot encode one).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Every byte as "0" for a digit, " " for anything else: a run of more digits than an
# integer may have is then a substring search, at C speed. Text without one (nearly
# all) leaves json its own integer parsing instead of a Python call per integer.
DIGIT_RUNS = bytes(48 if 48 <= byte <= 57 else 32 for byte in range(256))
LONG_DIGITS = b"0" * (MAX_INT_DIGITS + 1)
IS_CONTAINER = frozenset((dict, list)).__contains__


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonError(f"an integer has {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError("a number is too large for a float (it would be written as Infinity)")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are distinct (``json`` alone keeps the last of each)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        twice = next(key for key, count in Counter(k for k, _ in pairs).items() if count > 1)
        raise JsonError(f"an object names the key {twice[:40]!r} twice")
    return value


def _check_depth(value: Any) -> None:
    """Nesting, a level at a time (no recursion limit to hit). Which children are
    containers is picked at C speed (compress over their types), so a row's many
    numbers cost no Python step each."""
    level = [value]
    for _ in range(MAX_DEPTH):
        deeper: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            deeper += compress(children, map(IS_CONTAINER, map(type, children)))
        if not deeper:
            return
        level = deeper
    raise JsonError(f"values are nested deeper than {MAX_DEPTH} levels")


def _check_strings(value: Any) -> None:
    """Every string, keys too, must be valid Unicode (a lone surrogate is not)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise JsonError("a string holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node


def parse_json(text: str | bytes, finite: bool = True) -> Any:
    """Parse strict JSON; raise :class:`JsonError` with the reason. Bytes must be UTF-8,
    with or without a BOM (json.loads would also take UTF-16 and UTF-32).

    ``finite=False`` leaves a number too large for a float to the caller, who then
    encodes what it read canonically (which refuses it) anyway: a ledger row, read to
    check its hash. Its floats are then parsed at C speed, not by a call each."""
    try:
        text = text.decode("utf-8-sig") if isinstance(text, bytes) else text
        encoded = text.encode("utf-8")  # a string given may hold a lone surrogate itself
        integers = _integer if LONG_DIGITS in encoded.translate(DIGIT_RUNS) else int
        floats = _float if finite else float
        value = json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_float=floats,
            parse_int=integers,
        )
    except JsonError:
        raise
    except RecursionError:
        raise JsonError(f"values are nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise JsonError("the bytes are not UTF-8") from None
    except UnicodeEncodeError:
        raise JsonError("a string holds a lone surrogate (not valid Unicode)") from None
    except json.JSONDecodeError as exc:
        raise JsonError(f"malformed JSON ({exc.msg})") from None
    except ValueError as exc:
        raise JsonError(f"malformed JSON ({exc})") from None
    if isinstance(value, dict | list):
        _check_depth(value)
    if SURROGATE_ESCAPE.search(text):
        _check_strings(value)
    return value


def read_json(path: Path, what: str) -> Any:
    """A whole JSON file; bad input names ``what`` (e.g. "the stage plan file p.json")."""
    try:
        return parse_json(read_regular(path))
    except OSError as exc:
        raise KvreplayError(f"Cannot read {what} ({exc.strerror or exc}).") from exc
    except JsonError as exc:
        raise KvreplayError(f"Cannot read {what}: {exc}.") from exc


# A JSON text's strings and the punctuation around its objects: enough to find every
# object's keys without a Python step per number.
_KEY_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]:]')
# What a number, a separator or white space is made of: deleted (at C speed) before the
# keys are looked for, so that an array of a million numbers leaves "[]"; a key may lose
# characters too, so a key named twice there is confirmed on the whole text.
_NUMBERS = b"0123456789.+-eE, \t\r\n"


def _repeated_key(data: bytes) -> str | None:
    """The first key an object of valid JSON names twice, at any depth, or None; values
    nested deeper than :data:`MAX_DEPTH` are refused."""
    stack: list[set[bytes] | None] = []
    previous: bytes | None = None
    for match in _KEY_TOKENS.finditer(data):
        token = match.group()
        first = token[:1]
        if first in (b"{", b"["):
            stack.append(set() if first == b"{" else None)
            if len(stack) > MAX_DEPTH:
                raise JsonError(f"values are nested deeper than {MAX_DEPTH} levels")
        elif first in (b"}", b"]"):
            if stack:
                stack.pop()
        elif first == b":" and previous is not None and stack and stack[-1] is not None:
            key = previous[1:-1] if b"\\" not in previous else json.loads(previous).encode()
            if key in stack[-1]:
                return key.decode("utf-8", "replace")
            stack[-1].add(key)
        previous = token if first == b'"' else None
    return None


def _unique_keys(data: bytes, value: Any) -> None:
    """Refuse an object that names a key twice, at any depth (orjson keeps the last), and
    nesting deeper than :data:`MAX_DEPTH`. A line that is one object of lists and
    scalars (a logged rollout) is settled by counting: without an escape a string holds
    no quote, so every '":' left once the numbers are gone ends a key, and as many as
    the object holds means none was named twice."""
    reduced = data.translate(None, _NUMBERS)
    if b"\\" in reduced:  # an escape in a string: read the whole text
        reduced = data
    elif (
        type(value) is dict
        and reduced.count(b"{") == 1
        and reduced.count(b"[") < MAX_DEPTH
        and reduced.count(b'":') == len(value)
    ):
        return
    if _repeated_key(reduced) is None:
        return
    twice = _repeated_key(data)
    if twice is not None:
        raise JsonError(f"an object names the key {twice[:40]!r} twice")


def parse_json_fast(data: bytes) -> Any:
    """:func:`parse_json` with ``finite=False`` (a number too large for a float comes back
    as infinity, for the caller to refuse), at about ten times its speed: orjson parses a
    logged rollout's thousands of numbers without making a string of each, as the standard
    library does. Strict JSON either way (orjson refuses NaN, bad UTF-8 and lone
    surrogates itself; a key named twice and deep nesting are refused here; a byte order
    mark is read past)."""
    import orjson  # a core dependency, imported here so that the docs build needs it not

    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        # what orjson refuses, the strict reader reads (1e400 as infinity) or refuses in
        # its own words
        return parse_json(data, finite=False)
    if isinstance(value, dict | list):
        _unique_keys(body, value)
    return value
