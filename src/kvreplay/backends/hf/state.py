"""Boundary states in transformers' cache (``DynamicCache``): the only module that touches
transformers ``Cache`` internals. A sliding-window layer (Gemma3) stores only its window;
its cumulative length is kept alongside."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import DynamicCache

from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.model.state import BoundaryState, Component, read_state_metadata


@dataclass
class HfState(BoundaryState):
    """A boundary state held in a transformers ``DynamicCache``."""

    cache: DynamicCache

    @classmethod
    def empty(cls, model: Any, construction: str) -> HfState:
        return cls(DynamicCache(config=model.config), None, [], construction)

    @torch.inference_mode()
    def advance(self, model: Any, ids: Sequence[int]) -> None:
        """Feed ``ids`` as one chunk; only the last position's logits are computed.

        Computing just the last row (``logits_to_keep=1``) keeps the LM-head GEMM shape the
        same for every construction, so logits differences come from the cache alone.
        """
        device = model.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        out = model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.logits = out.logits[0, -1]
        self.token_ids.extend(int(t) for t in ids)

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def layer_lengths(self) -> list[int]:
        return [int(layer.get_seq_length()) for layer in self.cache.layers]

    def layer_kinds(self) -> list[str]:
        """Each layer's cache class and window."""
        return layer_kinds(self.cache)

    @torch.inference_mode()
    def copy(self) -> HfState:
        """Caches filled under inference mode deep-copy safely."""
        return HfState(
            cache=copy.deepcopy(self.cache),
            logits=None if self.logits is None else self.logits.clone(),
            token_ids=list(self.token_ids),
            construction=self.construction,
        )

    @torch.inference_mode()
    def take_layers(self, donor: BoundaryState, layers: list[int], component: Component) -> None:
        for index in layers:
            source, target = donor.cache.layers[index], self.cache.layers[index]
            if component in ("kv", "k"):
                target.keys = source.keys.clone()
            if component in ("kv", "v"):
                target.values = source.values.clone()


def config_layer_kinds(config: Any) -> list[str]:
    """The layer kinds of the cache a model of ``config`` builds (no weights needed):
    what a snapshot saved from that model holds."""
    return layer_kinds(DynamicCache(config=config))


def layer_kinds(cache: DynamicCache) -> list[str]:
    """Each layer's cache class and window: what a snapshot must match to load."""
    return [
        f"{type(layer).__name__}:{getattr(layer, 'sliding_window', 0) or 0}"
        for layer in cache.layers
    ]


@torch.inference_mode()
def load_state(path: Path, model: Any) -> HfState:
    """Rebuild a state saved by :func:`save_state` into a cache laid out for ``model``."""
    info = read_state_metadata(path)
    state = HfState.empty(model, info.construction)
    layers = state.cache.layers
    if len(layers) != len(info.layer_lengths):
        raise KvreplayError(
            f"The snapshot {path} has {len(info.layer_lengths)} layers "
            f"but the model has {len(layers)}."
        )
    with safe_open(str(path), framework="pt") as handle:
        try:
            saved_kinds = parse_json((handle.metadata() or {}).get("layer_kinds", "null"))
        except JsonError:
            saved_kinds = None  # not a layout: refused below as another one
    if saved_kinds != layer_kinds(state.cache):
        raise KvreplayError(
            f"The snapshot {path} was saved from a model with another cache layout."
        )
    device = model.device
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        for i, layer in enumerate(layers):
            keys = handle.get_tensor(f"layers.{i}.keys")
            values = handle.get_tensor(f"layers.{i}.values")
            if keys.dtype != model.dtype:
                raise KvreplayError(
                    f"The snapshot {path} holds a {keys.dtype} cache but the model runs in "
                    f"{model.dtype}."
                )
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = info.layer_lengths[i]
        state.logits = handle.get_tensor("logits")
        state.token_ids = [int(t) for t in handle.get_tensor("token_ids").tolist()]
    if state.layer_lengths() != info.layer_lengths:
        raise KvreplayError(f"The snapshot {path} does not fit this model's cache layout.")
    return state
