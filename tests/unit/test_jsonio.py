"""Strict JSON (jsonio.py): what it refuses, whichever way the input reaches it."""

from __future__ import annotations

import pytest

from kvreplay.core.jsonio import MAX_DEPTH, JsonError, parse_json


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"a": "\\ud800"}', "lone surrogate"),  # an escape in the text
        ('{"\\udfff": 1}', "lone surrogate"),  # in a key
        ('["\ud800"]', "lone surrogate"),  # a string given that holds one itself
        ("[1e400]", "too large for a float"),
        ('{"a": [-1e999]}', "too large for a float"),
        ("[NaN]", "NaN is not a JSON number"),
        ("[" + "7" * 65 + "]", "an integer has 65 digits"),
        ("[1.8e308]", "too large for a float"),  # a 3-digit exponent: checked per number
        ("[" + "9" * 309 + ".0]", "too large for a float"),  # as many digits, no exponent
        (" -2E+0400", "too large for a float"),  # a number alone, its exponent padded
        ('{"digest": "5e123", "x": [1, \n 9.5e307, 1e310]}', "too large for a float"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper than"),
        ('{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1), "nested deeper than"),
        (b"\xff[]", "not UTF-8"),
    ],
)
def test_refused_with_its_reason(text: str | bytes, reason: str) -> None:
    with pytest.raises(JsonError, match=reason):
        parse_json(text)


def test_accepted_as_written() -> None:
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(nested) is not None
    assert parse_json('{"emoji": "\\ud83d\\ude00", "x": [1.5, -2, "ok"]}') == {
        "emoji": "\U0001f600",
        "x": [1.5, -2, "ok"],
    }
    assert parse_json(b'\xef\xbb\xbf{"bom": true}') == {"bom": True}


@pytest.mark.parametrize(
    "text",
    ["[1e99, -2.5e-99, 0.1]", "[1.7e308, 5e-324]", "[" + "7" * 64 + "]", "[0." + "3" * 80 + "]"],
)
def test_numbers_at_the_limits_read_as_python_reads_them(text: str) -> None:
    import json

    assert parse_json(text) == json.loads(text)


def test_integers_parse_the_same_with_or_without_the_fast_path() -> None:
    """Text where no digit run is longer than an integer may be takes json's own integer
    parsing; every value must be what the checked parsing gives, and a long digit run
    in a string only sends the text the checked way."""
    assert parse_json("[1e-300, 2.5E+99, -7, 0.1, 12345678901234567890]") == [
        1e-300, 2.5e99, -7, 0.1, 12345678901234567890,
    ]  # fmt: skip
    assert parse_json('{"s": "' + "9" * 80 + '", "n": 3}') == {"s": "9" * 80, "n": 3}
    with pytest.raises(JsonError, match="digits"):
        parse_json("[" + "9" * 65 + "]")
    with pytest.raises(JsonError, match="too large"):
        parse_json("[1e400]")


FAST_CASES = [
    (b'{"a": [1, 2.5, -3e-2], "b": {"c": "x"}}', None),
    (b'\xef\xbb\xbf{"a": 1}', None),
    (b'{"a": 1e400}', None),  # infinity, for the caller to refuse, as parse_json reads it
    (b'{"a": 1, "a": 2}', "names the key 'a' twice"),
    (b'{"x": [{"k": 1, "k": 2}]}', "names the key 'k' twice"),
    (b'{"a": 1, "\\u0061": 2}', "names the key 'a' twice"),
    (b'{"a1": 1, "a2": 2, "a 1": [1, 2]}', None),  # keys alike once digits are gone
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": "\\ud800"}', "lone surrogate"),
    (b"[" * 70 + b"]" * 70, "nested deeper than 64 levels"),
    # one object of lists and scalars, settled by counting its keys
    (b'{"a": [1, 2], "b": "x:y", "a": [3]}', "names the key 'a' twice"),
    (b'{"u": "http://x", "v": [1], "w": ""}', None),
    (b'{"e1": [1], "e2": [2], "step": 3, "stp": 4}', None),  # alike once digits are gone
    (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", "nested deeper than 64 levels"),
]


@pytest.mark.parametrize(("text", "refused"), FAST_CASES)
def test_the_fast_reader_reads_as_the_strict_one(text: bytes, refused: str | None) -> None:
    """parse_json_fast (orjson, and the strict reader for what orjson refuses) reads as
    parse_json(finite=False)."""
    from kvreplay.core import jsonio

    if refused is None:
        assert jsonio.parse_json_fast(text) == parse_json(text, finite=False)
    else:
        with pytest.raises(JsonError, match=refused):
            jsonio.parse_json_fast(text)
