"""What a check expects of a stack (design: expectation, level): ``exact`` (every suffix
equal: the tokens level), ``max-divergent`` (at most K items part), ``bitwise`` (every
compared step bit-equal: the bits level, what a deterministic mode promises) and
``faithful`` (the resample certificate within a margin, temperature > 0), with the rate a
pass must bound (``--max-rate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvreplay.core.errors import KvreplayError
from kvreplay.core.power import items_needed

EXPECTATIONS = ("exact", "max-divergent", "bitwise", "faithful")
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Expectation:
    """What the stack should do: ``exact`` (every suffix equal), ``max-divergent`` (at
    most ``max_divergent`` items differ), ``bitwise`` (every compared step bit-equal),
    or ``faithful`` (the resample certificate at ``margin``, temperature > 0).
    ``max_rate``: run until a pass bounds the divergence rate under it."""

    kind: str
    max_divergent: int = 0
    margin: float = DEFAULT_MARGIN
    max_rate: float | None = None

    @property
    def level(self) -> str:
        """The level the verdict holds at: tokens, bits, or the certificate's."""
        return {"bitwise": "bits", "faithful": "certificate"}.get(self.kind, "tokens")

    @property
    def allowed(self) -> int:
        """Items that may part at the expectation's level."""
        return self.max_divergent if self.kind == "max-divergent" else 0

    def describe(self) -> str:
        if self.kind == "exact":
            return "every suffix equal"
        if self.kind == "max-divergent":
            return f"at most {self.max_divergent} item(s) divergent"
        if self.kind == "bitwise":
            return "every compared step bit-equal"
        return f"faithful within the margin {self.margin:g}"

    def items_needed(self) -> int | None:
        """How many items a pass must hold over to bound the rate under ``max_rate``."""
        return None if self.max_rate is None else items_needed(self.max_rate, self.allowed)


def parse_expectation(
    kind: str | None,
    max_divergent: int | None,
    margin: float | None,
    temperature: float,
    max_rate: float | None = None,
) -> Expectation:
    """The expectation a check runs against; the default is ``exact`` when greedy and
    ``faithful`` at temperature > 0. Bad combinations are refused in one sentence."""
    if kind is None:
        kind = "max-divergent" if max_divergent is not None else None
        kind = kind or ("faithful" if temperature > 0 else "exact")
    if kind not in EXPECTATIONS:
        raise KvreplayError(f"Unknown expectation {kind!r}; choose {', '.join(EXPECTATIONS)}.")
    if kind == "faithful" and temperature <= 0:
        raise KvreplayError(
            "--expect faithful compares sampled outcomes; give --temperature above 0."
        )
    if kind != "faithful" and temperature > 0:
        raise KvreplayError(
            f"--expect {kind} compares greedy continuations; at --temperature above 0 use "
            "--expect faithful."
        )
    if margin is not None and not 0 < margin < 1:
        raise KvreplayError(f"--margin must lie in (0, 1); got {margin:g}.")
    if margin is not None and kind != "faithful":
        raise KvreplayError("--margin applies to --expect faithful only.")
    if max_divergent is not None and kind != "max-divergent":
        raise KvreplayError("--max-divergent applies to --expect max-divergent only.")
    if max_rate is not None:
        if not (math.isfinite(max_rate) and 0 < max_rate < 1):
            raise KvreplayError(
                f"--max-rate is a divergence rate strictly between 0 and 1 (e.g. 0.05); "
                f"got {max_rate:g}."
            )
        if kind == "faithful":
            raise KvreplayError(
                "--max-rate bounds a greedy check's divergence rate; --expect faithful "
                "is judged by its certificate instead."
            )
    return Expectation(
        kind, max_divergent or 0, DEFAULT_MARGIN if margin is None else margin, max_rate
    )
