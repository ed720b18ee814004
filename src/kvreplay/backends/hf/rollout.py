"""The hf backend's rollout side (design: rollout stack, scorer): transformers as a
rollout stack (:class:`~kvreplay.backends.state_rollout.StateRollout` over its cache) and
as the trainer's scorer: one forward over the prompt and the sampled tokens, every
position's logits, as a trainer computes its log-probabilities. Imports torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvreplay.backends.state_rollout import ReplayScorer, StateRollout, scored
from kvreplay.core.rollout import Scored


class HfPrefill:
    """One plain forward of transformers over the whole sequence (no cache reused), the
    logits of every position: the log-probability of each sampled token is read from the
    row before it."""

    def __init__(self, lm: Any, name: str):
        self.lm, self.name = lm, name

    @torch.inference_mode()
    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        ids = torch.tensor([[*prompt_ids, *token_ids]], dtype=torch.long, device=self.lm.device)
        logits = self.lm.model(input_ids=ids).logits[0]
        return scored(logits[len(prompt_ids) - 1 : -1], token_ids)


def rollout_stack(lm: Any) -> StateRollout:
    return StateRollout(lm, f"hf:{lm.dtype_name}")


def scorer(lm: Any, schedule: str) -> HfPrefill | ReplayScorer:
    name = f"hf:{lm.dtype_name} {schedule}"
    return HfPrefill(lm, name) if schedule == "prefill" else ReplayScorer(lm, name)
