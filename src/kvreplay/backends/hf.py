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

    def state_layout(
        self, spec: str, trust_remote_code: bool, tokens: int
    ) -> tuple[list[str], list[int]]:
        """transformers' cache for the config; a sliding layer counts every token it saw."""
        from kvreplay.models import model_config
        from kvreplay.state import config_layer_kinds

        kinds = config_layer_kinds(model_config(spec, trust_remote_code))
        return kinds, [tokens] * len(kinds)
