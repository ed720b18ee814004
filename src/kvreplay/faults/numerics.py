"""The perturbations the faults apply to numbers an engine holds."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def one_ulp_up(tensor: torch.Tensor) -> None:
    """Move every element of ``tensor`` one unit in the last place (its bits + 1)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    tensor.view(bits).add_(1)


def lossy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` stored as 8-bit floats (e4m3) and read back."""
    clamped = tensor.float().clamp(-E4M3_MAX, E4M3_MAX)
    return clamped.to(torch.float8_e4m3fn).to(tensor.dtype)
