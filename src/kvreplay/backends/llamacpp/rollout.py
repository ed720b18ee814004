"""The llamacpp backend's rollout side (design: rollout stack, scorer): llama.cpp as a
rollout stack (:class:`~kvreplay.backends.state_rollout.StateRollout` over its sequence
state: kvreplay picks each token from the logits llama.cpp returns) and as a scorer that
evaluates the whole sequence in one ``llama_decode`` with logits requested for every
scored position (one micro-batch: ``n_batch`` = ``n_ubatch`` = ``n_ctx``). Imports
torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
import torch

from kvreplay.backends.state_rollout import ReplayScorer, StateRollout, scored
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Scored


class LlamaPrefill:
    """The prompt and the sampled tokens decoded as one batch in a fresh context, with
    the logits of every position from the prompt's last on."""

    def __init__(self, lm: Any, name: str):
        self.lm, self.name = lm, name

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        runtime = self.lm.model
        ids = [*prompt_ids, *token_ids]
        first = len(prompt_ids) - 1
        if len(ids) > runtime.n_ctx:
            raise KvreplayError(
                f"A sequence of {len(ids)} tokens exceeds llama.cpp's context of "
                f"{runtime.n_ctx} (--n-ctx)."
            )
        context, lib = runtime.context(), runtime.lib
        batch = lib.llama_batch_init(len(ids), 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i] = int(token), i
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                batch.logits[i] = first <= i < len(ids) - 1
            batch.n_tokens = len(ids)
            status = lib.llama_decode(context.handle, batch)
        finally:
            lib.llama_batch_free(batch)
        if status != 0:
            raise KvreplayError(f"llama.cpp could not decode {len(ids)} tokens (status {status}).")
        shape = (runtime.n_vocab,)
        rows = [
            numpy.ctypeslib.as_array(lib.llama_get_logits_ith(context.handle, i), shape)
            for i in range(first, len(ids) - 1)
        ]
        return scored(torch.from_numpy(numpy.stack(rows)), token_ids)


def rollout_stack(lm: Any) -> StateRollout:
    return StateRollout(lm, f"llamacpp:{lm.dtype_name}")


def scorer(lm: Any, schedule: str) -> LlamaPrefill | ReplayScorer:
    name = f"llamacpp:{lm.dtype_name} {schedule}"
    return LlamaPrefill(lm, name) if schedule == "prefill" else ReplayScorer(lm, name)
