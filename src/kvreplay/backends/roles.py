"""The roles a backend may play in the rollout experiments (design: rollout stack,
scorer, weight update arm), as protocols: sampling with each token's log-probability,
teacher-forcing token ids, and updating its weights mid-run. A backend says it can play
them through its capabilities and returns one from ``Backend.rollout_stack`` /
``Backend.scorer`` / ``Backend.weight_updater``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvreplay.core.rollout import Conversation, Scored, Turn

if TYPE_CHECKING:
    from kvreplay.model.update import WeightUpdate


class RolloutStack(Protocol):
    """A backend that samples with log-probabilities."""

    name: str  # e.g. "vllm:bf16": the stack as a sentence names it
    reports: tuple[str, ...]  # the log-probabilities it can report: raw, processed
    batches: bool  # whether conversations sampled together share the engine's batches

    def reset_cache(self) -> None:
        """Forget every prompt computed so far (a prefix cache's blocks), so that the next
        request is computed afresh."""

    def sample(self, conversations: Sequence[Conversation], reuse: bool) -> list[list[Turn]]:
        """Each conversation's turns, sampled together. With ``reuse`` a later turn's
        prompt continues from what its earlier turns computed (a serving engine's
        prefix-cache hit over the blocks prefill and decode wrote; in process, the live
        decoder state); without, every turn's whole prompt is computed afresh."""
        ...


class Scorer(Protocol):
    """A backend that teacher-forces token ids."""

    name: str  # e.g. "hf:fp32 prefill"

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        """Each of ``token_ids``' log-probabilities (raw) after the prompt and the tokens
        before it, computed in this scorer's schedule."""
        ...


class WeightUpdater(Protocol):
    """A rollout engine whose weights a run updates mid-run through the engine's own path
    (design: weight update arm), as an RL step syncs new weights into it."""

    inflight: bool  # whether a running request can continue across an update

    def sync(self, weights: WeightUpdate | None) -> None:
        """Load ``weights`` (None: the run's own) through the engine's own path, then reset
        its prefix cache: a correct sync, after which no request reads a block the old
        weights wrote."""

    def sample_inflight(self, conversation: Conversation, at: int, weights: WeightUpdate) -> Turn:
        """A rollout whose weights are updated to ``weights`` once it has sampled ``at``
        tokens, its later tokens decoded over the K/V the old weights wrote (no reset:
        what asynchronous RL does with a request in flight)."""
        ...
