"""How a ledger's columns are held in memory while analysis reads them: each kind of
value in the fewest bytes that give every reader the same numbers (a flag in a bit, a
text value as a code into its few distinct values, a digest as its 32 bytes), in
arrays sized for the rows before they are read. A reader gets a column as a plain numpy
array, unpacked when it asks (:meth:`Ledger.__getitem__
<kvreplay.harness.table.Ledger.__getitem__>`): analysis of any ledger holds about 100
bytes a row of the matrix CSV."""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.dtypes import StringDType

from kvreplay.harness.columns import Kind

# The numpy dtype each kind of number is held as (eight bytes). A digest is held as its
# 32 bytes (a Python string of its hex would take 113).
_NUMBERS: dict[str, Any] = {
    "int": np.int64,
    "optional_int": np.float64,
    "float": np.float64,
    "optional_float": np.float64,
}
DIGEST = np.dtype("S32")


@dataclass(frozen=True)
class Bits:
    """A flag column held as bits, eight rows a byte (a numpy boolean takes a byte): a
    matrix row holds about twenty flags."""

    packed: np.ndarray
    size: int

    def unpacked(self) -> np.ndarray:
        return np.unpackbits(self.packed, count=self.size).view(np.bool_)


@dataclass(frozen=True)
class Codes:
    """A text column held as each row's number into its distinct values (a precision or
    a backend is one of a few): a byte a row where a pointer takes eight."""

    values: np.ndarray  # each distinct value once, as objects
    codes: np.ndarray

    def unpacked(self) -> np.ndarray:
        return self.values[self.codes]


Held = np.ndarray | Bits | Codes
"""A column as a ledger holds it."""


def unpacked(values: Held) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.unpacked()


def mapped(size: int, dtype: Any) -> np.ndarray:
    """An array in memory of its own (an anonymous mapping), given back to the system
    when it is dropped: for a scratch array as large as the rows, which the C allocator
    would otherwise keep after it is freed."""
    dtype = np.dtype(dtype)
    return np.frombuffer(mmap.mmap(-1, max(1, size * dtype.itemsize)), dtype=dtype, count=size)


class HeldColumn:
    """One column's typed values as they stream in, into an array sized for the lines
    the CSV has (counted before it is read, where it is a file), grown by doubling past
    that: a column grown a value at a time would leave the allocator holding each
    buffer it outgrew."""

    def __init__(self, dtype: Any, capacity: int) -> None:
        self.values = np.zeros(max(capacity, 1), dtype=dtype)
        self.count = 0

    def _room(self, size: int) -> None:
        """At least ``size`` slots, doubling the array when they are not there."""
        if size > self.values.shape[0]:
            grown = np.zeros(2 * self.values.shape[0], dtype=self.values.dtype)
            grown[: self.values.shape[0]] = self.values
            self.values = grown

    def append(self, value: Any) -> None:
        self._room(self.count + 1)
        self.values[self.count] = value
        self.count += 1

    def finish(self) -> Held:
        return self.values[: self.count]


class _Flags(HeldColumn):
    """A flag column's values set as bits as they stream in (:class:`Bits`)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(np.uint8, (capacity + 7) // 8)

    def append(self, value: Any) -> None:
        byte, bit = divmod(self.count, 8)
        self._room(byte + 1)
        if value:
            self.values[byte] |= 0x80 >> bit
        self.count += 1

    def finish(self) -> Bits:
        return Bits(self.values[: (self.count + 7) // 8], self.count)


class _Digests(HeldColumn):
    """A digest column's values as their 32 bytes, from the hex a CSV holds."""

    def __init__(self, capacity: int) -> None:
        super().__init__(DIGEST, capacity)

    def append(self, value: Any) -> None:
        super().append(bytes.fromhex(value))


class _Text(HeldColumn):
    """A text column's values numbered as they stream in (:class:`Codes`), the codes
    widened when a column has more distinct values than they can number."""

    def __init__(self, capacity: int) -> None:
        super().__init__(np.uint8, capacity)
        self.numbers: dict[Any, int] = {}  # each distinct value (text, or None) once

    def append(self, value: Any) -> None:
        number = self.numbers.setdefault(value, len(self.numbers))
        if number > np.iinfo(self.values.dtype).max:
            self.values = self.values.astype(np.min_scalar_type(2 * number))
        super().append(number)

    def finish(self) -> Codes:
        values = np.empty(len(self.numbers), dtype=object)
        values[:] = [sys.intern(v) if isinstance(v, str) else v for v in self.numbers]
        return Codes(values, self.values[: self.count])


def column_for(kind: Kind, capacity: int) -> HeldColumn:
    """An empty column of ``kind``, with room for ``capacity`` values."""
    if kind == "bool":
        return _Flags(capacity)
    if kind == "sha256":
        return _Digests(capacity)
    if kind in _NUMBERS:
        return HeldColumn(_NUMBERS[kind], capacity)
    if kind in ("text", "optional_text"):
        return _Text(capacity)
    return HeldColumn(object, capacity)  # an optional flag or digest, a list: as objects


def id_column(capacity: int) -> HeldColumn:
    """A ledger's row ids, each different: numpy strings (16 bytes, a short one inline)."""
    return HeldColumn(StringDType(), capacity)
