"""Boundary states: a KV cache over a prefix plus the logits at its last position.

What every backend's states share: comparison, replicas, transplants, fingerprints and
snapshots, over :meth:`BoundaryState.layer_tensors`. Tensors keep the cache layout
``[batch, kv_heads, seq, head_dim]`` everywhere; sliding-window layers (Gemma3) store only
their window, and every operation here works on them as stored, with the layer's
cumulative length checked alongside.

Fingerprints are SHA-256 over canonical bytes: for each tensor in a fixed order, an ASCII
header ``name|dtype|shape\\n`` and then the tensor's raw little-endian bytes (C order).
Token sequences are committed as SHA-256 of canonical JSON (``[1,2,3]``), as in the
paper's release.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvreplay.core.comparison import Comparison
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import parse_json

Component = Literal["kv", "k", "v"]
STATE_FORMAT = "kvreplay-boundary-state-v1"


def fingerprint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over a dtype/shape header and the raw bytes of each tensor, in order."""
    digest = hashlib.sha256()
    for name, tensor in named:
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        header = f"{name}|{str(flat.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n"
        digest.update(header.encode("ascii"))
        digest.update(flat.view(torch.uint8).numpy())  # hashed in place, no byte copy
    return digest.hexdigest()


@dataclass
class BoundaryState(ABC):
    """A decoder state over ``token_ids``: K/V over them (``cache``, held as the backend
    holds it) and the logits at the last position.

    ``advance`` feeds tokens through the model and mutates the state in place; every
    construction and every continuation is a sequence of ``advance`` calls. Each backend
    with K/V access subclasses this (transformers' cache: ``backends/hf/state.py``;
    llama.cpp's sequence state; vLLM's cached blocks), so every comparison, replica,
    transplant and snapshot below runs unchanged on it.
    """

    cache: Any
    logits: torch.Tensor | None
    token_ids: list[int]
    construction: str

    @property
    def position(self) -> int:
        return len(self.token_ids)

    def argmax(self) -> int:
        assert self.logits is not None, "an empty state has no boundary logits"
        return int(torch.argmax(self.logits).item())

    @abstractmethod
    def advance(self, model: Any, ids: Sequence[int]) -> None:
        """Feed ``ids`` as one chunk through ``model``; the logits become the last one's."""

    @abstractmethod
    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V, ``[batch, kv_heads, seq, head_dim]``."""

    @abstractmethod
    def layer_lengths(self) -> list[int]:
        """Tokens each layer has seen (a sliding layer stores fewer than it has seen)."""

    @abstractmethod
    def layer_kinds(self) -> list[str]:
        """Each layer's cache kind: what a snapshot must match to load."""

    @abstractmethod
    def copy(self) -> BoundaryState:
        """A storage-disjoint deep copy."""

    @abstractmethod
    def take_layers(self, donor: BoundaryState, layers: list[int], component: Component) -> None:
        """Replace this state's K and/or V in ``layers`` by copies of the donor's."""

    def named_cache_tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for i, (keys, values) in enumerate(self.layer_tensors()):
            named += [(f"layers.{i}.keys", keys), (f"layers.{i}.values", values)]
        return named

    def cache_fingerprint(self) -> str:
        return fingerprint_tensors(self.named_cache_tensors())

    def storages(self) -> set[int]:
        """The addresses of the memory this state's tensors live in."""
        tensors = [t for pair in self.layer_tensors() for t in pair]
        if self.logits is not None:
            tensors.append(self.logits)
        return {t.untyped_storage().data_ptr() for t in tensors}

    def logits_fingerprint(self) -> str:
        assert self.logits is not None
        return fingerprint_tensors([("logits", self.logits)])


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: same dtype, shape and bytes (so -0.0 differs from 0.0 and a
    NaN equals itself), which is what "exact" means in every gate and fingerprint."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        as_int = _SAME_WIDTH_INT[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def storage_disjoint(a: BoundaryState, b: BoundaryState) -> bool:
    """True when no memory of ``a`` is memory of ``b``."""
    return not (a.storages() & b.storages())


@dataclass(frozen=True)
class ReplicaCheck:
    """The integrity gate of a replica: bit-equal to its source, sharing no storage."""

    cache_exact: bool
    logits_exact: bool
    storage_disjoint: bool

    @property
    def passed(self) -> bool:
        return self.cache_exact and self.logits_exact and self.storage_disjoint


def clone(state: BoundaryState) -> BoundaryState:
    """A storage-disjoint copy of ``state``."""
    return state.copy()


def make_replica(state: BoundaryState) -> tuple[BoundaryState, ReplicaCheck]:
    """Clone ``state`` and check the clone: bit-equal and no shared storage."""
    replica = clone(state)
    cache_exact = replica.layer_lengths() == state.layer_lengths() and all(
        bit_equal(a, b)
        for pa, pb in zip(state.layer_tensors(), replica.layer_tensors(), strict=True)
        for a, b in zip(pa, pb, strict=True)
    )
    logits_exact = state.logits is not None and bit_equal(state.logits, replica.logits)
    return replica, ReplicaCheck(cache_exact, logits_exact, storage_disjoint(state, replica))


@dataclass
class DiffStats:
    """Elementwise difference of two equally shaped tensor groups, accumulated in fp64."""

    exact: bool = True
    count: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    delta_sq: float = 0.0
    left_sq: float = 0.0
    right_sq: float = 0.0

    def add(self, left: torch.Tensor, right: torch.Tensor) -> None:
        a, b = left.detach().double(), right.detach().double()
        delta = a - b
        magnitude = delta.abs()
        self.exact = self.exact and bit_equal(left, right)
        self.count += delta.numel()
        if delta.numel():
            self.max_abs = max(self.max_abs, float(magnitude.max()))
        self.sum_abs += float(magnitude.sum())
        self.delta_sq += float((delta * delta).sum())
        self.left_sq += float((a * a).sum())
        self.right_sq += float((b * b).sum())

    def merge(self, other: DiffStats) -> None:
        self.exact = self.exact and other.exact
        self.count += other.count
        self.max_abs = max(self.max_abs, other.max_abs)
        self.sum_abs += other.sum_abs
        self.delta_sq += other.delta_sq
        self.left_sq += other.left_sq
        self.right_sq += other.right_sq

    def summary(self) -> dict[str, float | bool]:
        delta, left, right = (math.sqrt(x) for x in (self.delta_sq, self.left_sq, self.right_sq))
        scale = max(left, right)
        return {
            "exact": self.exact,
            "max_abs_diff": self.max_abs,
            "mean_abs_diff": self.sum_abs / self.count if self.count else 0.0,
            "delta_l2_norm": delta,
            "left_l2_norm": left,
            "right_l2_norm": right,
            "relative_l2_diff": delta / scale if scale > 0 else 0.0,
        }


def check_same_prefix(a: BoundaryState, b: BoundaryState) -> None:
    """Two states are comparable only over the same prefix with the same cache shapes."""
    if a.token_ids != b.token_ids:
        raise KvreplayError("The two boundary states cover different prefixes.")
    shapes_a = [(k.shape, v.shape) for k, v in a.layer_tensors()]
    shapes_b = [(k.shape, v.shape) for k, v in b.layer_tensors()]
    if shapes_a != shapes_b:
        raise KvreplayError("The two boundary states have caches of different shapes.")
    dtypes_a = {t.dtype for pair in a.layer_tensors() for t in pair}
    dtypes_b = {t.dtype for pair in b.layer_tensors() for t in pair}
    if dtypes_a != dtypes_b:
        raise KvreplayError("The two boundary states hold caches of different dtypes.")


def compare(left: BoundaryState, right: BoundaryState) -> Comparison:
    """Compare two states over the same prefix: cache (overall, per layer, K/V) and logits."""
    check_same_prefix(left, right)
    keys_total, values_total, cache_total = DiffStats(), DiffStats(), DiffStats()
    per_layer = []
    for (lk, lv), (rk, rv) in zip(left.layer_tensors(), right.layer_tensors(), strict=True):
        k, v = DiffStats(), DiffStats()
        k.add(lk, rk)
        v.add(lv, rv)
        kv = DiffStats()
        kv.merge(k)
        kv.merge(v)
        keys_total.merge(k)
        values_total.merge(v)
        cache_total.merge(kv)
        per_layer.append({"k": k.summary(), "v": v.summary(), "kv": kv.summary()})
    logits = DiffStats()
    assert left.logits is not None and right.logits is not None
    logits.add(left.logits, right.logits)
    return Comparison(
        cache=cache_total.summary(),
        keys=keys_total.summary(),
        values=values_total.summary(),
        per_layer=per_layer,
        logits=logits.summary(),
        boundary_argmax_equal=left.argmax() == right.argmax(),
        layer_lengths_equal=left.layer_lengths() == right.layer_lengths(),
    )


def _resolve_layers(state: BoundaryState, layers: Iterable[int] | None) -> list[int]:
    count = len(state.layer_lengths())
    chosen = list(range(count)) if layers is None else sorted(set(layers))
    for index in chosen:
        if not 0 <= index < count:
            raise KvreplayError(f"Layer index {index} is out of range for a {count}-layer cache.")
    return chosen


def transplant(
    donor: BoundaryState,
    recipient: BoundaryState,
    layers: Iterable[int] | None = None,
    component: Component = "kv",
    carry_logits: bool = False,
) -> BoundaryState:
    """A copy of ``recipient`` whose K and/or V in ``layers`` come from ``donor``.

    The boundary logits stay the recipient's unless ``carry_logits``: a K/V transplant
    changes what later tokens attend to, not the logits already computed at the boundary.
    Donor and recipient must cover the same prefix with equal cache shapes.
    """
    if component not in ("kv", "k", "v"):
        raise KvreplayError(f"Unknown component {component!r}; choose kv, k or v.")
    check_same_prefix(donor, recipient)
    chosen = _resolve_layers(recipient, layers)
    result = clone(recipient)
    result.take_layers(donor, chosen, component)
    if carry_logits:
        assert donor.logits is not None
        result.logits = donor.logits.clone()
    suffix = "all" if layers is None else ",".join(map(str, chosen))
    result.construction = (
        f"transplant({donor.construction}->{recipient.construction};{suffix};{component})"
    )
    return result


@dataclass
class SavedState:
    """What a snapshot file holds besides tensors."""

    construction: str
    layer_lengths: list[int]
    cache_fingerprint: str
    logits_fingerprint: str
    extra: dict[str, str] = field(default_factory=dict)


def save_state(state: BoundaryState, path: Path, extra: dict[str, str] | None = None) -> SavedState:
    """Write ``state`` as safetensors with its fingerprints in the metadata (no pickle)."""
    assert state.logits is not None
    info = SavedState(
        construction=state.construction,
        layer_lengths=state.layer_lengths(),
        cache_fingerprint=state.cache_fingerprint(),
        logits_fingerprint=state.logits_fingerprint(),
        extra=dict(extra or {}),
    )
    tensors = {name: t.detach().contiguous().cpu() for name, t in state.named_cache_tensors()}
    tensors["logits"] = state.logits.detach().contiguous().cpu()
    tensors["token_ids"] = torch.tensor(state.token_ids, dtype=torch.long)
    metadata = {
        "format": STATE_FORMAT,
        "layer_kinds": json.dumps(state.layer_kinds()),
        "construction": info.construction,
        "layer_lengths": json.dumps(info.layer_lengths),
        "cache_fingerprint": info.cache_fingerprint,
        "logits_fingerprint": info.logits_fingerprint,
        "extra": json.dumps(info.extra, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return info


def read_state_metadata(path: Path) -> SavedState:
    """Read a snapshot's metadata without loading its tensors."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user problem
        raise KvreplayError(f"The snapshot {path} is not a readable safetensors file.") from exc
    if meta.get("format") != STATE_FORMAT:
        raise KvreplayError(f"The file {path} is not a kvreplay boundary-state snapshot.")
    try:
        saved = SavedState(
            construction=meta["construction"],
            layer_lengths=parse_json(meta["layer_lengths"]),
            cache_fingerprint=meta["cache_fingerprint"],
            logits_fingerprint=meta["logits_fingerprint"],
            extra=parse_json(meta.get("extra", "{}")),
        )
    except (KeyError, ValueError) as exc:
        raise KvreplayError(
            f"The snapshot {path} has missing or malformed metadata ({type(exc).__name__}: {exc})."
        ) from exc
    if not (isinstance(saved.layer_lengths, list) and isinstance(saved.extra, dict)):
        raise KvreplayError(f"The snapshot {path} has malformed layer_lengths or extra metadata.")
    return saved


# The metadata keys save_state writes, and the tensors beside a cache's layers.
SNAPSHOT_METADATA = frozenset(
    ("format", "layer_kinds", "construction", "layer_lengths", "cache_fingerprint",
     "logits_fingerprint", "extra")
)  # fmt: skip
SNAPSHOT_EXTRA_TENSORS = ("logits", "token_ids")


def cache_tensor_names(layers: int) -> list[str]:
    """The names of a snapshot's cache tensors, in fingerprint order."""
    return [f"layers.{i}.{part}" for i in range(layers) for part in ("keys", "values")]


@dataclass(frozen=True)
class SnapshotContents:
    """What a snapshot file holds, read from its bytes: its metadata as written, the
    names of its tensors, the token ids it was saved over, and the fingerprints of its
    cache and logits computed from the tensors (the metadata only says what they were)."""

    metadata: dict[str, str]
    tensors: frozenset[str]
    token_ids: list[int] | None
    cache_fingerprint: str
    logits_fingerprint: str


def read_snapshot(path: Path) -> SnapshotContents:
    """A snapshot's contents, for an audit (see :class:`SnapshotContents`)."""
    layers = len(read_state_metadata(path).layer_lengths)
    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = dict(handle.metadata() or {}), frozenset(handle.keys())  # noqa: SIM118
        try:
            cache = fingerprint_tensors(
                (name, handle.get_tensor(name)) for name in cache_tensor_names(layers)
            )
            logits = fingerprint_tensors([("logits", handle.get_tensor("logits"))])
        except Exception as exc:  # noqa: BLE001 - a missing tensor is the same user problem
            raise KvreplayError(f"The snapshot {path} lacks a tensor its metadata names.") from exc
        ids = handle.get_tensor("token_ids") if "token_ids" in tensors else None
    token_ids = (
        ids.tolist() if ids is not None and ids.dtype == torch.long and ids.dim() == 1 else None
    )
    return SnapshotContents(metadata, tensors, token_ids, cache, logits)
