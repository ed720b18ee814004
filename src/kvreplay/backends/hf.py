"""The hf backend: transformers eager, with full K/V access, so every experiment runs on
it. Its contract names no backend, so runs made before backends existed keep their
contract and hash.

It is a backend like the others: transformers' loading checks and its model loading live
here (through :mod:`kvreplay.model.models`), not in the protocol's defaults, so no other backend
imports transformers to be checked.
"""

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

    def check_loadable(self, spec: str, attn_implementation: str, trust_remote_code: bool) -> None:
        """transformers must build the model from its config on the meta device with this
        attention implementation, and its weights must fit the config and be finite."""
        from kvreplay.model.models import check_loadable
        from kvreplay.model.sources import resolve_source
        from kvreplay.model.weights import check_finite_weights

        check_loadable(spec, attn_implementation, trust_remote_code)
        folder, gguf_file = resolve_source(spec, trust_remote_code)
        if gguf_file is None:
            check_finite_weights(folder, spec)

    def state_layout(
        self, spec: str, trust_remote_code: bool, tokens: int
    ) -> tuple[list[str], list[int]]:
        """transformers' cache for the config; a sliding layer counts every token it saw."""
        from kvreplay.model.models import model_config
        from kvreplay.model.state import config_layer_kinds

        kinds = config_layer_kinds(model_config(spec, trust_remote_code))
        return kinds, [tokens] * len(kinds)

    def load_model(self, config: Any, precision: str, device_map: str | None = None) -> Any:
        """transformers' model for one precision, on the run's device and attention."""
        from kvreplay.model.models import load_model

        return load_model(
            config.model,
            precision,
            config.device,
            config.attn_implementation,
            config.trust_remote_code,
            device_map,
        )
