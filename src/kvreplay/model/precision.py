"""The precisions and devices a run may name, checked before any model work: the short
dtype names a ledger records (and the torch dtype each stands for), and a device this
machine can provide. Torch-free: the core install (no torch) names precisions too."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from kvreplay.core.errors import KvreplayError

DTYPES = ("fp32", "bf16", "fp16")
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> Any:
    """The torch dtype a short name stands for (imports torch)."""
    import torch

    return getattr(torch, _TORCH_NAMES[name])


def parse_dtype(name: str, allowed: Iterable[str] = DTYPES) -> str:
    """Validate a dtype name; the ledger always records these short names."""
    choices = list(allowed)
    if name not in choices:
        raise KvreplayError(f"Unknown dtype {name!r}; choose one of {', '.join(choices)}.")
    return name


def parse_dtypes(names: Iterable[str], allowed: Iterable[str] = DTYPES) -> tuple[str, ...]:
    """A run's precisions: at least one, each one ``allowed`` (a backend's), none twice
    (a row key per precision)."""
    choices = list(allowed)
    dtypes = tuple(parse_dtype(name, choices) for name in names)
    if not dtypes:
        raise KvreplayError("--dtypes needs at least one dtype.")
    repeated = sorted({d for d in dtypes if dtypes.count(d) > 1})
    if repeated:
        raise KvreplayError(f"--dtypes names {repeated[0]} twice; list each precision once.")
    return dtypes


def parse_device(name: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused here when this machine cannot provide it."""
    match = re.fullmatch(r"cpu|cuda(?::([0-9]{1,3}))?", name)
    if match is None:
        raise KvreplayError(f"Unknown device {name!r}; use cpu, cuda or cuda:N.")
    if name == "cpu":
        return name
    from kvreplay.core.extras import require

    require("hf", f"Device {name!r}", "torch")
    import torch

    if not torch.cuda.is_available():
        raise KvreplayError(f"Device {name!r} was requested but CUDA is not available here.")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise KvreplayError(
            f"Device {name!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s)."
        )
    return name
