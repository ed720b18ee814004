"""A comparison of two boundary states as rows record it (design: comparison), and where
two token sequences first part. Plain data, no torch: ``state.compare`` computes one,
the typed rows and the CSVs read it back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# What a comparison records of each of cache, keys, values and logits (and per layer of
# k, v and kv): model/state.py: DiffStats.summary writes these.
STAT_FIELDS = (
    "exact",
    "max_abs_diff",
    "mean_abs_diff",
    "delta_l2_norm",
    "left_l2_norm",
    "right_l2_norm",
    "relative_l2_diff",
)
RETIRED = "first_suffix_divergence_index"
"""A field rows recorded before it was dropped: a comparison of boundary states never
knew where the suffixes part (the pair's labels say it), so it was always null."""


@dataclass
class Comparison:
    """Everything docs/design.md asks of a comparison of two boundary states."""

    cache: dict[str, float | bool]
    keys: dict[str, float | bool]
    values: dict[str, float | bool]
    per_layer: list[dict[str, dict[str, float | bool]]]
    logits: dict[str, float | bool]
    boundary_argmax_equal: bool
    layer_lengths_equal: bool

    @property
    def cache_exact(self) -> bool:
        return bool(self.cache["exact"]) and self.layer_lengths_equal

    @property
    def logits_exact(self) -> bool:
        return bool(self.logits["exact"])

    def relative_l2_by_layer(self) -> list[float]:
        """Relative L2 of K and V together, one value per layer (for drift figures)."""
        return [float(layer["kv"]["relative_l2_diff"]) for layer in self.per_layer]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        return cls(**as_written(data))


def as_written(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded comparison as kvreplay writes it now: an earlier row's null
    :data:`RETIRED` field dropped (any other value is kept, for readers to refuse)."""
    if RETIRED in recorded and recorded[RETIRED] is None:
        return {k: v for k, v in recorded.items() if k != RETIRED}
    return recorded


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix; None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
