"""How a continuation picks its tokens: greedy, or seeded temperature/top-p sampling.

Torch-free to import (torch is imported when a token is picked), so that a run's settings
are built and validated in the core install, where a server does the sampling (design:
core install vs extras).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import option

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sampler:
    """Greedy when ``temperature`` is 0; otherwise seeded temperature/top-p sampling.

    Each continuation draws from its own generator seeded with ``seed``, so two arms (or
    a state and its replica) see the same random stream and differ only by their state.
    """

    temperature: float = field(
        default=0.0,
        metadata=option(
            "--temperature",
            "0 is greedy; above 0 samples with --seed (several samples an item take seeds "
            "--seed, --seed+1, ...).",
        ),
    )
    top_p: float = field(
        default=1.0, metadata=option("--top-p", "Nucleus sampling's probability mass (1: off).")
    )
    seed: int = field(default=0, metadata=option("--seed", "The sampler's seed."))

    def __post_init__(self) -> None:
        """Refuse NaN and infinities too (a comparison alone lets NaN through)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0 and 0 < self.top_p <= 1):
            raise KvreplayError("Sampling needs a finite temperature >= 0 and 0 < top_p <= 1.")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise KvreplayError("The sampling seed must be an integer in [0, 2**63).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        import torch

        return None if self.greedy else torch.Generator().manual_seed(self.seed)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        import torch

        if self.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator).item())
