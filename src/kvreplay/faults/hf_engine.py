"""The transformers fault (design: fault): a cache layer that rounds what it stores.

transformers' ``DynamicLayer.update`` appends a forward's new K/V to the layer and
returns the whole of it for that forward's attention. The hook keeps that return as it
is and stores the layer rounded to 8-bit floats (e4m3), as a lossy cache (an fp8 or
quantized one) would: a chunk attends to its own K/V unrounded and to earlier chunks' rounded, so a
one-shot prefill and a token-by-token decode of the same prefix read different numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.faults.numerics import lossy
from kvreplay.faults.patches import Patch


def lossy_cache() -> list[Patch]:
    from transformers.cache_utils import DynamicLayer

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def update(self: Any, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            keys, values = original(self, key_states, value_states, *args, **kwargs)
            self.keys, self.values = lossy(keys), lossy(values)
            return keys, values

        return update

    return [(DynamicLayer, "update", make)]
