"""A request shape as its row records it (design: request shape, comparison level): the
hit after the shape's history and its reference miss, read back as arms of the row, and
what they say: do they agree at the token level and bit for bit, did each read the
cached tokens it should, and does the shape part them at the level it is compared at
(a detection). The CSV, the verdict and the audit all read shapes through this."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvreplay.core.trajectory import numeric_divergence
from kvreplay.harness.rows import ArmResult, PanelRow, replica_name

Level = Literal["bits", "tokens"]
"""Where a shape is compared: ``bits`` (tokens and every step's reported top-k
log-probabilities, bit for bit) or ``tokens`` (the continuation's token ids)."""
LEVELS: tuple[str, ...] = get_args(Level)
CHOSEN_LEVELS = ("measured", *LEVELS)
"""What ``--level`` takes: the level the clean stack is measured exact at, or either."""

FIELD = "battery"
"""The row field that records the battery: its compared pair (the first shape that ran)
and each shape's level, whether its history happened and what it did, in the order the
shapes ran."""


CALIBRATION = "miss"
"""The arm of P's first miss; its replica, served the same way, calibrates the row: the
two must agree bit for bit (else the stack is not deterministic) and neither may read a
cached token (after a reset, a lookup that hits is a phantom)."""


def miss_arm(shape: str) -> str:
    return f"{shape}-miss"


def live_arm(shape: str) -> str:
    return f"{shape}-live"


@dataclass(frozen=True)
class ShapeOutcome:
    """One shape of a row: its level, whether its history happened (``exercised``;
    None: the engine cannot say), what it did (``note``), and its arms (none where the
    shape could not run on this engine or prompt)."""

    shape: str
    level: Level
    exercised: bool | None
    note: str | None
    hit: ArmResult | None
    miss: ArmResult | None
    live: ArmResult | None

    @classmethod
    def of(cls, row: PanelRow, entry: dict[str, Any]) -> ShapeOutcome:
        """The shape a row's entry names (``shape``, ``level``, ``exercised``, ``note``)."""
        shape = entry["shape"]
        return cls(
            shape, entry["level"], entry["exercised"], entry.get("note"),
            row.arms.get(shape), row.arms.get(miss_arm(shape)), row.arms.get(live_arm(shape)),
        )  # fmt: skip

    @property
    def ran(self) -> bool:
        return self.hit is not None and self.miss is not None

    @property
    def tokens_equal(self) -> bool:
        return not self.ran or self.hit.suffix_sha256 == self.miss.suffix_sha256  # type: ignore[union-attr]

    @property
    def bits_equal(self) -> bool:
        if not self.ran:
            return True
        assert self.hit is not None and self.miss is not None
        parted = numeric_divergence(self.hit.suffix, self.miss.suffix).parts
        return self.tokens_equal and not parted

    @property
    def hit_cached(self) -> int | None:
        return _cached(self.hit)

    @property
    def miss_cached(self) -> int | None:
        return _cached(self.miss)

    @property
    def expected_cached(self) -> int | None:
        served = self.hit.served if self.hit is not None else None
        return served.expected_cached_tokens if served is not None else None

    @property
    def cache_as_written(self) -> bool:
        """The miss read no cached token, and the hit read what its history wrote."""
        if self.miss_cached:
            return False
        expected = self.expected_cached
        return expected is None or self.hit_cached == expected

    def detected_at(self, level: Level) -> bool:
        """Whether the shape parts hit from miss at ``level`` (an unexercised one never)."""
        if self.exercised is False or not self.ran:
            return False
        equal = self.bits_equal if level == "bits" else self.tokens_equal
        return not (equal and self.cache_as_written)

    @property
    def detected(self) -> bool:
        return self.detected_at(self.level)

    @property
    def first_step(self) -> int | None:
        """The first step whose token or reported logprobs part (None: none do)."""
        if not self.ran:
            return None
        assert self.hit is not None and self.miss is not None
        return numeric_divergence(self.hit.suffix, self.miss.suffix).index

    @property
    def live_equal(self) -> bool | None:
        """``cut``: whether the hit continued as the live decode did at the cut, tokens
        and numerics (the paper's question inside the engine; reported, not judged)."""
        if self.live is None or self.hit is None:
            return None
        return not numeric_divergence(self.hit.suffix, self.live.suffix).parts

    def why(self) -> str:
        """What parted, in a few words."""
        if self.miss_cached:
            return f"its miss read {self.miss_cached} cached tokens after a reset"
        expected = self.expected_cached
        if expected is not None and self.hit_cached != expected:
            return f"its hit read {self.hit_cached} cached tokens where {expected} were written"
        what = "tokens" if not self.tokens_equal else "reported log-probabilities"
        return f"{what} part from step {self.first_step}"

    def to_json(self) -> dict[str, Any]:
        """What a verdict's JSON says of the shape."""
        return {
            "shape": self.shape,
            "level": self.level,
            "exercised": self.exercised,
            "detected": self.detected,
            "tokens_equal": self.tokens_equal,
            "bits_equal": self.bits_equal,
            "hit_cached_tokens": self.hit_cached,
            "expected_cached_tokens": self.expected_cached,
            "miss_cached_tokens": self.miss_cached,
            "first_divergent_step": self.first_step,
            "live_equal": self.live_equal,
            "note": self.note,
            **({"why": self.why()} if self.detected else {}),
        }


def _cached(arm: ArmResult | None) -> int | None:
    return arm.served.cached_tokens[0] if arm is not None and arm.served is not None else None


def calibration(row: PanelRow) -> tuple[bool, int]:
    """Whether the calibration misses agree bit for bit, and the most cached tokens
    either read after its reset (0 on a sound engine)."""
    first, again = row.arms[CALIBRATION], row.arms[replica_name(CALIBRATION)]
    agree = first.suffix_sha256 == again.suffix_sha256 and not (
        numeric_divergence(first.suffix, again.suffix).parts
    )
    return agree, max(_cached(first) or 0, _cached(again) or 0)


def shape_outcomes(row: PanelRow) -> list[ShapeOutcome]:
    """Every shape a battery row ran, in the order it ran them."""
    return [ShapeOutcome.of(row, entry) for entry in row.fields[FIELD]["shapes"]]


def is_battery(row: PanelRow) -> bool:
    return FIELD in row.fields
