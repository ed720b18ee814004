"""The manifest's contract: everything that can change a result, built from a run's
configuration, its model's identity, this machine's environment and its items. The
runner writes it; ``kvreplay audit`` builds it again on its own machine and compares."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.config import RunConfig
from kvreplay.contract.environment import KERNELS, environment
from kvreplay.core.items import Item, items_digest


def build_contract(
    config: RunConfig, info: dict[str, Any], items_source: str, items: list[Item], scheme: int
) -> dict[str, Any]:
    """The contract of a run in contract scheme ``scheme`` (a resumed run keeps its own)."""
    return {
        **({"scheme": scheme} if scheme > 1 else {}),
        "run": config.contract(),
        "model_info": info,
        "environment": environment(config.device, scheme)
        | config.backend.environment()
        | backend_kernels(config, scheme),
        "items": {"source": items_source, "digest": items_digest(items), "count": len(items)},
    }


def backend_kernels(config: RunConfig, scheme: int) -> dict[str, str]:
    """The backend's own kernel report, recorded from contract scheme 4 on."""
    report = config.backend.kernels() if scheme >= 4 else None
    return {KERNELS: report} if report else {}
