"""The hf backend: transformers eager, with full K/V access, so every experiment runs on
it. Its contract names no backend, so runs made before backends existed keep their
contract and hash."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreplay.backends.base import Backend, Capabilities


@dataclass(frozen=True)
class HfBackend(Backend):
    name = "hf"
    summary = "transformers eager, full K/V access (every experiment)"
    capabilities = Capabilities(kv_access=True, seeded_sampling=True)
    extra = "hf"
    requires = ("torch", "transformers")

    def contract(self) -> dict[str, Any] | None:
        return None
