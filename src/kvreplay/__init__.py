"""kvreplay: audit stage replay in LLM inference.

The public surface for notebooks: load a model, reach a boundary live or rebuild it by
any construction, clone, compare, fingerprint, transplant, save and continue.
"""

from kvreplay.construct import Prefix, build, live
from kvreplay.decode import Sampler, Trajectory, continue_from
from kvreplay.errors import KvreplayError
from kvreplay.items import Item, arith_items, encode_prompt, load_items
from kvreplay.models import LoadedModel, load_model
from kvreplay.stages import Stage, StagePlan, get_plan
from kvreplay.state import (
    BoundaryState,
    Comparison,
    clone,
    compare,
    fingerprint_tensors,
    first_divergence,
    load_state,
    make_replica,
    save_state,
    sha256_tokens,
    transplant,
)

__version__ = "0.1.0"

__all__ = [
    "BoundaryState",
    "Comparison",
    "Item",
    "KvreplayError",
    "LoadedModel",
    "Prefix",
    "Sampler",
    "Stage",
    "StagePlan",
    "Trajectory",
    "arith_items",
    "build",
    "clone",
    "compare",
    "continue_from",
    "encode_prompt",
    "fingerprint_tensors",
    "first_divergence",
    "get_plan",
    "live",
    "load_items",
    "load_model",
    "load_state",
    "make_replica",
    "save_state",
    "sha256_tokens",
    "transplant",
]
