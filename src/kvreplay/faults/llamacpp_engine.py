"""The llama.cpp faults (design: fault), each a hook on llama.cpp's C API as the
llamacpp backend reaches it: llama-cpp-python's ctypes module, whose functions the
backend looks up at every call (:mod:`kvreplay.backends.llamacpp.binding`). A hook wraps
one C function: restoring a saved state, decoding a batch, reading a batch's logits.

A saved state is the bytes llama.cpp writes (``llama_kv_cache::state_write``): a whole
context's state starts with the model's architecture name, a sequence's with a magic word
and its id; both then hold each layer's K and V rows, which
:func:`kvreplay.backends.llamacpp.runtime.parse_state` finds.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy

from kvreplay.backends.llamacpp.binding import binding
from kvreplay.backends.llamacpp.runtime import Q8_0, STATE_MAGIC, parse_state
from kvreplay.faults.patches import Patch


def address(ctx: Any) -> int:
    return int(ctypes.cast(ctx, ctypes.c_void_p).value or 0)


def flip_last_key(data: bytearray, memory: int) -> None:
    """Flip the lowest bit of the first K element of the last cell, layer 0, in a state
    whose K/V section starts at byte ``memory`` (q8_0: of the element's quant, not its
    block's scale)."""
    header = struct.pack("<Ii", STATE_MAGIC, 0)
    keys, _ = parse_state(header + bytes(data[memory:]))[0]
    row = keys.offset - len(header) + memory + (keys.count - 1) * keys.width
    data[row + (2 if keys.ggml_type == Q8_0 else 0)] ^= 1


def restore_perturbed() -> list[Patch]:
    lib = binding()

    def whole(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_state_set_data(ctx: Any, src: Any, size: int) -> Any:
            data = bytearray(ctypes.string_at(src, size))
            (name_length,) = struct.unpack_from("<I", data, 0)  # the architecture's name
            flip_last_key(data, 4 + name_length)
            return original(ctx, (ctypes.c_uint8 * size).from_buffer(data), size)

        return llama_state_set_data

    def sequence(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_state_seq_set_data(ctx: Any, src: Any, size: int, seq: int) -> Any:
            data = bytearray(ctypes.string_at(src, size))
            flip_last_key(data, 8)  # after the magic word and the sequence id
            return original(ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)

        return llama_state_seq_set_data

    return [(lib, "llama_state_set_data", whole), (lib, "llama_state_seq_set_data", sequence)]


def reeval_last() -> list[Patch]:
    """The engine's own token bookkeeping, as a server keeps it beside a saved state: the
    tokens each context was fed (by position), and of each saved state the tokens it
    holds. After a restore the last one is fed again at the next position, and the
    context's later batches are placed one position further on."""
    lib = binding()
    fed: dict[int, list[int]] = {}
    saved: dict[str, list[int]] = {}
    shift: dict[int, int] = {}
    real_decode = lib.llama_decode

    def decode(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_decode(ctx: Any, batch: Any) -> Any:
            key, count = address(ctx), int(batch.n_tokens)
            if count and batch.pos[0] == 0:  # a new sequence in this context
                fed[key], shift[key] = [], 0
            for i in range(count):
                batch.pos[i] += shift.get(key, 0)
            fed.setdefault(key, []).extend(int(batch.token[i]) for i in range(count))
            return original(ctx, batch)

        return llama_decode

    def save(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_state_get_data(ctx: Any, dst: Any, size: int) -> Any:
            written = original(ctx, dst, size)
            digest = hashlib.sha256(ctypes.string_at(dst, written)).hexdigest()
            saved[digest] = list(fed.get(address(ctx), []))
            return written

        return llama_state_get_data

    def restore(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_state_set_data(ctx: Any, src: Any, size: int) -> Any:
            done = original(ctx, src, size)
            tokens = saved.get(hashlib.sha256(ctypes.string_at(src, size)).hexdigest())
            if done and tokens:
                batch = lib.llama_batch_init(1, 0, 1)
                try:
                    batch.token[0], batch.pos[0] = tokens[-1], len(tokens)
                    batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, 1
                    batch.n_tokens = 1
                    real_decode(ctx, batch)
                finally:
                    lib.llama_batch_free(batch)
                key = address(ctx)
                fed[key], shift[key] = [*tokens, tokens[-1]], 1
            return done

        return llama_state_set_data

    return [
        (lib, "llama_decode", decode),
        (lib, "llama_state_get_data", save),
        (lib, "llama_state_set_data", restore),
    ]


def prefill_logits_ulp() -> list[Patch]:
    lib = binding()
    pending: set[int] = set()  # contexts whose last batch had several tokens, logits untouched

    def decode(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_decode(ctx: Any, batch: Any) -> Any:
            (pending.add if int(batch.n_tokens) > 1 else pending.discard)(address(ctx))
            return original(ctx, batch)

        return llama_decode

    def logits(original: Callable[..., Any]) -> Callable[..., Any]:
        def llama_get_logits_ith(ctx: Any, i: int) -> Any:
            row = original(ctx, i)
            if address(ctx) in pending:
                pending.discard(address(ctx))
                vocab = lib.llama_model_get_vocab(lib.llama_get_model(ctx))
                values = numpy.ctypeslib.as_array(row, (int(lib.llama_vocab_n_tokens(vocab)),))
                top = int(values.argmax())
                values[top] = numpy.nextafter(values[top], numpy.float32(numpy.inf))
            return row

        return llama_get_logits_ith

    return [(lib, "llama_decode", decode), (lib, "llama_get_logits_ith", logits)]
