"""How a continuation picks its tokens: greedy, or seeded temperature/top-p sampling.

Torch-free to import (torch is imported when a token is picked), so that a run's settings
are built and validated in the core install, where a server does the sampling (design:
core install vs extras).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import SEEDS, bounds, check_bounds, option

if TYPE_CHECKING:
    import torch


MIN_TEMPERATURE = 1e-4  # above 0, the least: logits divided by less overflow float32
MAX_TEMPERATURE = 100.0  # past this every sampler's distribution is uniform to float precision


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
            f"--seed, --seed+1, ...); from {MIN_TEMPERATURE:g} up when above 0.",
            minimum=0,
            maximum=MAX_TEMPERATURE,
        ),
    )
    top_p: float = field(
        default=1.0,
        metadata=option(
            "--top-p", "Nucleus sampling's probability mass (1: off).", minimum=0, maximum=1
        ),
    )
    seed: int = field(default=0, metadata=option("--seed", "The sampler's seed.", **bounds(SEEDS)))

    def __post_init__(self) -> None:
        """Its declared bounds (NaN and infinities refused too), a top-p above 0, and a
        temperature above 0 that divides no logit into an overflow."""
        check_bounds(self)
        if self.top_p == 0:
            raise KvreplayError("--top-p must be above 0 (1 turns nucleus sampling off).")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise KvreplayError(
                f"--temperature {self.temperature!r} is above 0 and below {MIN_TEMPERATURE:g}: "
                "logits divided by it overflow, so no distribution is sampled; use 0 (greedy) "
                f"or at least {MIN_TEMPERATURE:g}."
            )

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
