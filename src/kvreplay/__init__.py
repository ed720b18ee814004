"""kvreplay: audit stage replay in LLM inference.

The public surface for notebooks: load a model, reach a boundary live or rebuild it by
any construction, clone, compare, fingerprint, transplant, save and continue. Names are
imported on first use (PEP 562) so that ``kvreplay analyze`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvreplay.core.version import VERSION

__version__ = VERSION

_EXPORTS = {
    "kvreplay.core.canonical": ("sha256_tokens",),
    "kvreplay.core.comparison": ("Comparison", "first_divergence"),
    "kvreplay.model.construct": ("build", "live"),
    "kvreplay.model.decode": ("continue_from",),
    "kvreplay.core.errors": ("KvreplayError",),
    "kvreplay.core.items": ("Item", "arith_items", "encode_prompt", "load_items"),
    "kvreplay.backends.hf.loading": ("LoadedModel", "load_model"),
    "kvreplay.backends.hf.state": ("HfState", "load_state"),
    "kvreplay.core.sampler": ("Sampler",),
    "kvreplay.core.stages": ("Stage", "StagePlan", "get_plan"),
    "kvreplay.model.state": (
        "BoundaryState",
        "clone",
        "compare",
        "fingerprint_tensors",
        "make_replica",
        "save_state",
        "transplant",
    ),
    "kvreplay.core.trajectory": ("Prefix", "Trajectory"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
