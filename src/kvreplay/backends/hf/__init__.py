"""The hf backend: transformers eager in this process, with full K/V access, so every
experiment runs on it. It is a backend like the others: its settings (the attention
implementation, remote code) are its own, and so are transformers' loading
(:mod:`~kvreplay.backends.hf.loading`) and its cache (:mod:`~kvreplay.backends.hf.state`);
no other backend imports transformers to be checked or run.

A contract names it like any other backend. Contracts recorded before it did (an hf run
named no backend, and every run held the attention and remote-code settings beside the
model) are read through :func:`kvreplay.contract.upgrade.current`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvreplay.backends.base import (
    Backend,
    Capabilities,
    ModelRef,
    option,
    trust_remote_code_setting,
)


@dataclass(frozen=True)
class HfBackend(Backend):
    name = "hf"
    summary = "transformers eager, full K/V access (every experiment)"
    capabilities = Capabilities(kv_access=True, seeded_sampling=True, rollout=True, scoring=True)
    extra = "hf"
    requires = ("torch", "transformers")
    trainer_loads = ("pretrained", "cast")
    attn_implementation: str = field(
        default="sdpa",
        metadata=option("--attn", "Attention implementation passed to transformers."),
    )
    trust_remote_code: bool = trust_remote_code_setting()

    def check_model(self, spec: str, device: str, dtypes: tuple[str, ...]) -> None:
        """transformers must build the model from its config on the meta device with this
        attention implementation, and its weights must fit the config and be finite."""
        from kvreplay.backends.hf.loading import check_loadable
        from kvreplay.model.sources import resolve_source
        from kvreplay.model.weights import check_finite_weights

        check_loadable(spec, self.attn_implementation, self.trust_remote_code)
        folder, gguf_file = resolve_source(spec, self.trust_remote_code)
        if gguf_file is None:
            check_finite_weights(folder, spec)

    def kernels(self) -> str | None:
        """What differs from torch's usual choice here (see ``cpu_flash_unusable``)."""
        from kvreplay.backends.hf.loading import cpu_flash_unusable

        if self.attn_implementation == "sdpa" and cpu_flash_unusable():
            return "sdpa math on CPU (flash needs torch's AVX-512 kernels on a CPU with AMX)"
        return None

    def state_layout(self, spec: str, tokens: int) -> tuple[list[str], list[int]]:
        """transformers' cache for the config; a sliding layer counts every token it saw."""
        from kvreplay.backends.hf.state import config_layer_kinds
        from kvreplay.model.reading import model_config

        kinds = config_layer_kinds(model_config(spec, self.trust_remote_code))
        return kinds, [tokens] * len(kinds)

    def load_model(
        self, model: ModelRef, precision: str, device_map: str | None = None, cast: bool = True
    ) -> Any:
        """transformers' model for one precision, on the run's device and attention: every
        floating tensor cast to it (``cast``, as every run loads), or as
        ``from_pretrained`` leaves it."""
        from kvreplay.backends.hf.loading import load_model

        return load_model(
            model.spec,
            precision,
            model.device,
            self.attn_implementation,
            self.trust_remote_code,
            device_map,
            cast,
        )

    def load_trainer(self, model: ModelRef, precision: str, load: str) -> Any:
        return self.load_model(model, precision, cast=load == "cast")

    def rollout_stack(self, opened: Any) -> Any:
        from kvreplay.backends.hf.rollout import rollout_stack

        return rollout_stack(opened)

    def rollout_logprobs(self) -> tuple[str, ...]:
        return ("raw", "processed")  # kvreplay samples from the logits and computes both

    def scorer(self, opened: Any, schedule: str = "prefill") -> Any:
        from kvreplay.backends.hf.rollout import scorer

        return scorer(opened, schedule)
