"""llama.cpp's side of the llamacpp backend: a GGUF model, the contexts it decodes in,
and the boundary states they hold.

Each boundary state owns one llama.cpp context holding one sequence, so two states never
share memory; a copy is the context's whole state (``llama_state_get_data``) written into
a fresh context. The K/V of a state are read from its sequence's state bytes
(``llama_state_seq_get_data``) as llama.cpp's KV-cache writer lays them out, so
comparisons, fingerprints and transplants work on the very cache llama.cpp decodes from.
Every chunk of a construction is one ``llama_decode`` of one micro-batch (``n_batch`` =
``n_ubatch`` = ``n_ctx``): ``prefill`` is one shot, ``live`` and ``replay`` feed the
prompt in one and every later token alone.
"""

from __future__ import annotations

import ctypes
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from kvreplay.backends.llamacpp.binding import KV_TYPES, binding
from kvreplay.core.errors import KvreplayError
from kvreplay.model.state import BoundaryState, Component

# How rows of each type read: plain types as their dtype; q8_0 as blocks of 32 int8
# values with an fp16 scale (34 bytes), dequantized to fp32.
ROW_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
Q8_0, Q8_0_BLOCK = 8, 34
STATE_MAGIC = 0xAF143CD8  # llama_context's io_magic: the first word of a sequence's state


class Runtime:
    """One GGUF model loaded by llama.cpp, and the contexts its states decode in."""

    def __init__(
        self,
        path: Path,
        n_ctx: int,
        flash_attn: str,  # the backend's setting: on or off
        threads: int,
        kv: str,
        vocab_only: bool = False,
    ):
        self.lib = lib = binding()
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise KvreplayError(f"llama.cpp cannot load the GGUF file {path.name}.")
        weakref.finalize(self, lib.llama_model_free, self.model)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx, self.flash_attn, self.threads, self.kv = n_ctx, flash_attn, threads, kv
        self.generation_config = None  # EOS comes from the tokenizer (decode.eos_ids)

    def context(self) -> Context:
        """A fresh context with one empty sequence."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = KV_TYPES[self.kv]
        params.flash_attn_type = 1 if self.flash_attn == "on" else 0
        params.no_perf = True
        handle = lib.llama_init_from_model(self.model, params)
        if not handle:
            raise KvreplayError("llama.cpp could not make a context (out of memory?).")
        return Context(self, handle)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        room = len(data) + 16
        out = (self.lib.llama_token * room)()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), out, room, add_special, True)
        return [int(t) for t in out[: max(count, 0)]]


class Context:
    """A llama.cpp context decoding one sequence: a boundary state's storage."""

    def __init__(self, runtime: Runtime, handle: Any):
        self.runtime, self.handle = runtime, handle
        self._finalizer = weakref.finalize(self, runtime.lib.llama_free, handle)
        self._layers: tuple[bytes, list[tuple[Rows, Rows]]] | None = None

    @property
    def address(self) -> int:
        return int(ctypes.cast(self.handle, ctypes.c_void_p).value or 0)

    def decode(self, ids: Sequence[int], position: int) -> torch.Tensor:
        """Feed ``ids`` from ``position`` as one micro-batch; the last position's logits."""
        lib, count = self.runtime.lib, len(ids)
        self._layers = None
        batch = lib.llama_batch_init(count, 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i] = int(token), position + i
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                batch.logits[i] = i == count - 1
            batch.n_tokens = count
            status = lib.llama_decode(self.handle, batch)
        finally:
            lib.llama_batch_free(batch)
        if status != 0:
            raise KvreplayError(f"llama.cpp could not decode {count} tokens (status {status}).")
        row = lib.llama_get_logits_ith(self.handle, -1)
        return torch.from_numpy(numpy.ctypeslib.as_array(row, (self.runtime.n_vocab,)).copy())

    def layers(self) -> tuple[bytes, list[tuple[Rows, Rows]]]:
        """The sequence's state bytes and each layer's K and V rows in them. Read and
        parsed once per change of the context (a panel asks several times per state):
        every method that changes it (decode, restore, write) drops them first."""
        if self._layers is None:
            data = self.read()
            self._layers = data, parse_state(data)
        return self._layers

    def read(self) -> bytes:
        """The sequence's state: its cells and every layer's K and V rows."""
        lib = self.runtime.lib
        size = lib.llama_state_seq_get_size(self.handle, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(self.handle, buffer, size, 0)
        return bytes(buffer)[:written]

    def snapshot(self) -> bytes:
        """The whole context's state: every cell, masked sliding-window ones included."""
        lib = self.runtime.lib
        size = lib.llama_state_get_size(self.handle)
        buffer = (ctypes.c_uint8 * size)()
        written = lib.llama_state_get_data(self.handle, buffer, size)
        return bytes(buffer)[:written]

    def restore(self, data: bytes) -> None:
        """Become the context :meth:`snapshot` saw, cell for cell."""
        self._layers = None
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if not self.runtime.lib.llama_state_set_data(self.handle, buffer, len(data)):
            raise KvreplayError("llama.cpp refused a context state it wrote itself.")

    def write(self, data: bytes) -> None:
        """Replace the sequence by ``data`` (from :meth:`read`)."""
        lib = self.runtime.lib
        self._layers = None
        lib.llama_memory_clear(lib.llama_get_memory(self.handle), True)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if lib.llama_state_seq_set_data(self.handle, buffer, len(data), 0) != len(data):
            raise KvreplayError("llama.cpp refused a sequence state it wrote itself.")


@dataclass(frozen=True)
class Rows:
    """Where one layer's K or V lies in a sequence's state bytes: ``count`` rows of
    ``width`` bytes (V may be stored transposed: a row per channel, a column per cell)."""

    ggml_type: int
    offset: int
    count: int
    width: int
    transposed: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.count * self.width

    def tensor(self, data: bytes) -> torch.Tensor:
        """The rows as a ``[cells, channels]`` tensor of the cache's dtype (q8_0:
        dequantized to fp32)."""
        raw = torch.frombuffer(bytearray(data[self.offset : self.end]), dtype=torch.uint8)
        if self.ggml_type == Q8_0 and not self.transposed:
            blocks = raw.reshape(self.count, -1, Q8_0_BLOCK)
            scale = blocks[..., :2].contiguous().view(torch.float16).float()
            values = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (scale * values).reshape(self.count, -1)
        dtype = ROW_DTYPES.get(self.ggml_type)
        if dtype is None:
            raise KvreplayError(
                f"kvreplay cannot read llama.cpp KV rows of GGML type {self.ggml_type}."
            )
        rows = raw.view(dtype).reshape(self.count, -1)
        return rows.T if self.transposed else rows


def parse_state(data: bytes) -> list[tuple[Rows, Rows]]:
    """Each layer's K and V rows in a sequence's state bytes, as llama.cpp's KV-cache
    writer (``llama_kv_cache::state_write``) emits them; refused unless every byte is
    accounted for."""
    magic, _ = struct.unpack_from("<Ii", data, 0)
    if magic != STATE_MAGIC:
        raise KvreplayError("A llama.cpp sequence state does not start with its magic word.")
    offset, layers = 8, []
    try:
        while offset < len(data):
            (streams,) = struct.unpack_from("<I", data, offset)
            offset += 4
            for _ in range(streams):
                (cells,) = struct.unpack_from("<I", data, offset)
                offset += 4
                if cells:
                    offset, found = _parse_stream(data, offset, cells)
                    layers += found
    except struct.error as exc:
        raise KvreplayError("A llama.cpp sequence state ends inside its K/V rows.") from exc
    if offset != len(data) or not layers:
        raise KvreplayError("kvreplay cannot lay out this model's llama.cpp sequence state.")
    return layers


def _parse_stream(data: bytes, offset: int, cells: int) -> tuple[int, list[tuple[Rows, Rows]]]:
    for _ in range(cells):  # each cell: its position and the sequences holding it
        _, sequences = struct.unpack_from("<iI", data, offset)
        offset += 8 + 4 * sequences
    transposed, count = struct.unpack_from("<II", data, offset)
    offset += 8
    keys = []
    for _ in range(count):
        ggml_type, width = struct.unpack_from("<iQ", data, offset)
        keys.append(Rows(ggml_type, offset + 12, cells, width))
        offset = keys[-1].end
    values = []
    for _ in range(count):
        if transposed:
            ggml_type, element, channels = struct.unpack_from("<iII", data, offset)
            values.append(Rows(ggml_type, offset + 12, channels, cells * element, True))
        else:
            ggml_type, width = struct.unpack_from("<iQ", data, offset)
            values.append(Rows(ggml_type, offset + 12, cells, width))
        offset = values[-1].end
    return offset, list(zip(keys, values, strict=True))


@dataclass
class LlamaState(BoundaryState):
    """A boundary state held by a llama.cpp context (``cache``); its K/V are read from
    the sequence's state bytes (:meth:`Context.layers`)."""

    cache: Context

    @classmethod
    def empty(cls, model: Runtime, construction: str) -> LlamaState:
        return cls(model.context(), None, [], construction)

    def advance(self, model: Any, ids: Sequence[int]) -> None:
        self.logits = self.cache.decode(ids, self.position)
        self.token_ids.extend(int(t) for t in ids)

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        data, layers = self.cache.layers()
        return [(k.tensor(data), v.tensor(data)) for k, v in layers]

    def layer_lengths(self) -> list[int]:
        _, layers = self.cache.layers()
        return [k.count for k, _ in layers]

    def layer_kinds(self) -> list[str]:
        _, layers = self.cache.layers()
        return [f"llama.cpp:{k.ggml_type}:{v.ggml_type}:{int(v.transposed)}" for k, v in layers]

    def storages(self) -> set[int]:
        logits = set() if self.logits is None else {self.logits.untyped_storage().data_ptr()}
        return {self.cache.address} | logits

    def copy(self) -> LlamaState:
        """The context's whole state written into a fresh one: disjoint, and bit-equal by
        check. Not the sequence's state alone: that leaves out sliding-window cells
        already masked (Gemma3), and a context without them continued differently
        after a long prefill (the attention then reduces over other cells)."""
        context = self.cache.runtime.context()
        context.restore(self.cache.snapshot())
        logits = None if self.logits is None else self.logits.clone()
        return LlamaState(context, logits, list(self.token_ids), self.construction)

    def take_layers(self, donor: BoundaryState, layers: list[int], component: Component) -> None:
        """Splice the donor's K and/or V rows of ``layers`` into this sequence's bytes."""
        assert isinstance(donor, LlamaState)
        mine, rows = self.cache.layers()
        theirs, donor_rows = donor.cache.layers()
        spliced = bytearray(mine)
        for index in layers:
            for part, ours, source in zip("kv", rows[index], donor_rows[index], strict=True):
                if component not in ("kv", part):
                    continue
                if (ours.offset, ours.end) != (source.offset, source.end):
                    raise KvreplayError("The donor's llama.cpp K/V rows are laid out otherwise.")
                spliced[ours.offset : ours.end] = theirs[source.offset : source.end]
        self.cache.write(bytes(spliced))


@dataclass
class LlamaModel:
    """A GGUF model in llama.cpp at one KV-cache type: what experiments advance states
    through (the interface of :class:`~kvreplay.backends.hf.loading.LoadedModel`)."""

    model: Runtime
    tokenizer: Any
    spec: str
    dtype_name: str
    identity: Any
    info: dict[str, Any]
    context_length: int  # the backend's context window over the model's
    device: str = "cpu"

    @property
    def attn_implementation(self) -> str:
        return f"llama.cpp(flash_attn={self.model.flash_attn})"

    @property
    def num_layers(self) -> int:
        return int(self.info["num_layers"])

    @property
    def model_digest(self) -> str:
        return self.identity.describe()["model_digest"]

    def empty_state(self, construction: str) -> LlamaState:
        return LlamaState.empty(self.model, construction)
