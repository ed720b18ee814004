"""A GGUF file's metadata as its loaders would take it, read without them, and what in it
llama.cpp or transformers' GGUF conversion rejects deep inside a load (attention heads
that do not split the embedding, a special token id past the tokenizer's tokens): each
refused here in one sentence, before anything reads the weights.

Only the header is read (the metadata precedes the tensors), a value at a time: a number
is kept, an array is kept as its length, so a tokenizer's hundred thousand strings cost
one pass over their lengths.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from kvreplay.core.errors import KvreplayError

# GGUF value types: the struct format of each fixed-width one (0-7, 10-12), string, array.
FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
         10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9

Value = int | float | bool | str | None  # an array is its length (an int); a string kept


class _Reader:
    """Values from a mapped file at a moving offset; past the end raises struct.error."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def take(self, form: str) -> int | float | bool:
        (value,) = struct.unpack_from(form, self.data, self.at)
        self.at += struct.calcsize(form)
        return value

    def string(self) -> str:
        length = int(self.take("<Q"))
        if self.at + length > len(self.data):
            raise struct.error("a string runs past the end of the file")
        self.at += length
        return bytes(self.data[self.at - length : self.at]).decode("utf-8", "replace")

    def value(self, kind: int) -> Value:
        if kind in FIXED:
            return self.take(FIXED[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"an unknown value type {kind}")
        element, count = int(self.take("<I")), int(self.take("<Q"))
        if element in FIXED:
            self.at += struct.calcsize(FIXED[element]) * count
        else:
            for _ in range(count):
                self.value(element)
        if self.at > len(self.data):
            raise struct.error("an array runs past the end of the file")
        return count


def read_metadata(path: Path) -> dict[str, Value]:
    """The metadata's keys and values (an array as its length)."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data)
        if bytes(data[:4]) != b"GGUF":
            raise ValueError("it does not start with GGUF")
        reader.at = 8  # the magic and the version
        _tensors, count = reader.take("<Q"), int(reader.take("<Q"))
        metadata: dict[str, Value] = {}
        for _ in range(count):
            key = reader.string()
            metadata[key] = reader.value(int(reader.take("<I")))
        return metadata


def _count(metadata: dict[str, Value], key: str) -> int | None:
    value = metadata.get(key)
    return value if type(value) is int else None


def check_metadata(path: Path, spec: str) -> None:
    """Refuse (one sentence) the metadata a GGUF's loaders reject; see the module docstring."""
    try:
        metadata = read_metadata(path)
    except (OSError, ValueError, struct.error) as exc:
        raise KvreplayError(f"The GGUF file {spec!r} is damaged or truncated ({exc}).") from exc
    arch = metadata.get("general.architecture")
    width = _count(metadata, f"{arch}.embedding_length")
    heads = _count(metadata, f"{arch}.attention.head_count")
    kv_heads = _count(metadata, f"{arch}.attention.head_count_kv") or heads
    if heads is not None and (heads < 1 or kv_heads is None or kv_heads < 1):
        raise KvreplayError(f"The GGUF file {spec!r} gives {heads} attention heads.")
    if heads and width is not None and f"{arch}.attention.key_length" not in metadata:
        if width % heads:
            raise KvreplayError(
                f"The GGUF file {spec!r} gives an embedding of {width} for {heads} attention "
                "heads, which does not split into them."
            )
    if heads and kv_heads and heads % kv_heads:
        raise KvreplayError(
            f"The GGUF file {spec!r} gives {heads} attention heads for {kv_heads} key/value "
            "heads, which do not split them."
        )
    tokens = _count(metadata, "tokenizer.ggml.tokens")
    for key in sorted(k for k in metadata if k.startswith("tokenizer.ggml.") and k.endswith("_id")):
        token = _count(metadata, key)
        if token is not None and tokens is not None and not 0 <= token < tokens:
            raise KvreplayError(
                f"The GGUF file {spec!r} gives {key} {token}, outside its {tokens} tokens."
            )
