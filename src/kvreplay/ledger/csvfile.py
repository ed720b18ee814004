"""The derived ledger CSVs as bytes: byte-for-byte reproducible from rows.jsonl, and safe
to open in a spreadsheet."""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

# What a spreadsheet runs as a formula when a cell starts with it (OWASP, CSV injection).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def csv_cell(text: str) -> str:
    """A cell that a spreadsheet shows and never runs: text (an item id, an answer) that
    starts with a formula character gets OWASP's leading single quote. A number such as
    -0.5 is left as it is, so numeric columns keep their meaning."""
    if text.startswith(FORMULA_START) and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)
"""The largest field a CSV reader takes: a line of the rollout CSV holds a whole
response's log-probabilities (Python's default, 131,072 characters, is a 4k-token one)."""


def csv_reader(lines: Iterable[str]) -> Iterator[list[str]]:
    """:func:`csv.reader` for kvreplay's CSVs, with no field limit short of memory."""
    csv.field_size_limit(FIELD_LIMIT)
    return csv.reader(lines)


def csv_dict_reader(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """:class:`csv.DictReader` with no field limit (:func:`csv_reader`)."""
    csv.field_size_limit(FIELD_LIMIT)
    return csv.DictReader(lines)


def render_csv(columns: list[str], rows: Iterable[dict[str, str]]) -> str:
    """A derived ledger CSV, byte-for-byte reproducible from rows.jsonl."""
    return "".join(render_csv_lines(columns, rows))


def render_csv_lines(columns: list[str], rows: Iterable[dict[str, str]]) -> Iterator[str]:
    """:func:`render_csv` a line at a time (the header first), for a CSV of any length."""
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    yield buffer.getvalue()
    for row in rows:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow({name: csv_cell(cell) for name, cell in row.items()})
        yield buffer.getvalue()
