"""Columns held in fewer bytes give every reader the same values as plain arrays."""

from __future__ import annotations

import numpy as np
import pytest

from kvreplay.harness.held import Bits, Codes, column_for, id_column, mapped, unpacked


@pytest.mark.parametrize("capacity", [0, 1, 7, 8, 1000])  # sized right, too small, none
def test_flags_are_held_as_bits_and_read_back_as_booleans(capacity: int) -> None:
    flags = np.random.default_rng(0).random(1003) < 0.4
    column = column_for("bool", capacity)
    for flag in flags.tolist():
        column.append(flag)
    held = column.finish()
    assert isinstance(held, Bits) and held.packed.nbytes == (flags.size + 7) // 8
    assert unpacked(held).dtype == np.bool_ and np.array_equal(unpacked(held), flags)


def test_text_is_held_as_codes_widened_past_256_distinct_values() -> None:
    values = [f"v{i % 300}" for i in range(900)] + [None, "bf16"]
    column = column_for("optional_text", 10)
    for value in values:
        column.append(value)
    held = column.finish()
    assert isinstance(held, Codes) and held.codes.dtype == np.uint16 and held.values.size == 302
    assert unpacked(held).tolist() == values


def test_a_precision_column_takes_a_byte_a_row() -> None:
    column = column_for("text", 4)
    for value in ["bf16", "fp32", "bf16", "fp32"]:
        column.append(value)
    held = column.finish()
    assert isinstance(held, Codes) and held.codes.nbytes == 4
    assert (unpacked(held) == "fp32").tolist() == [False, True, False, True]


def test_numbers_digests_and_ids_keep_their_plain_arrays() -> None:
    digest = "ab" * 32
    for kind, value, dtype in [
        ("float", 0.1, np.float64),
        ("int", 2**40, np.int64),
        ("sha256", digest, np.dtype("S32")),
    ]:
        column = column_for(kind, 1)
        for _ in range(3):  # past its capacity: grown by doubling
            column.append(value)
        held = column.finish()
        assert isinstance(held, np.ndarray) and held.dtype == dtype and held.shape == (3,)
    ids = id_column(1)
    for row_id in ["a", "b" * 40]:
        ids.append(row_id)
    assert ids.finish().tolist() == ["a", "b" * 40]


def test_a_mapped_array_is_writable_and_sized_as_asked() -> None:
    array = mapped(5, np.dtype("V16"))
    array[:] = [bytes([i]) * 16 for i in range(5)][::-1]
    array.sort()
    assert array.shape == (5,) and array[0].tobytes() == bytes(16)
    assert mapped(0, np.int64).shape == (0,)
