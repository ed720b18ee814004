"""A rollout stack and the replay scorer over boundary states (design: rollout stack,
scorer): the in-process backends whose states kvreplay advances itself (hf's
transformers cache, llamacpp's sequence state). kvreplay picks each token from the
state's logits, so it computes both log-probabilities a sampler may report: *raw* (the
log-softmax of the logits) and *processed* (the log of the token's probability after
temperature, top-k and top-p); :func:`scored` turns a scorer's logits into the record
of a teacher-forced pass. Imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvreplay.core.rollout import Conversation, Sampling, Scored, Turn
from kvreplay.core.stages import eos_ids


def pick(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[int, float, float]:
    """One step of a sampler over a state's logits: the token taken, its log-probability
    in the mode the sampling names, and the top-1/top-2 gap of the raw log-probabilities.
    Greedy takes the raw argmax; otherwise the logits are divided by the temperature,
    cut to the top k and then to the nucleus of mass top-p, and the token is drawn from
    what is left with the seeded generator."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(raw, 2).values
    margin = float(top[0] - top[1])
    if sampling.greedy:
        token = int(torch.argmax(raw).item())
        return token, float(raw[token]), margin
    scaled = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if sampling.top_p < 1:
        probs = torch.softmax(scaled, dim=-1)
        ordered, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(ordered, dim=-1) - ordered >= sampling.top_p
        scaled = scaled.clone()
        scaled[order[drop]] = -torch.inf
    processed = torch.log_softmax(scaled, dim=-1)
    token = int(torch.multinomial(processed.exp(), 1, generator=generator).item())
    chosen = raw if sampling.logprobs == "raw" else processed
    return token, float(chosen[token]), margin


def decode_turn(
    state: Any, model: Any, sampling: Sampling, eos: frozenset[int], cached: int
) -> Turn:
    """Sample one turn from a state whose logits follow its prompt (the live schedule:
    every sampled token fed alone; the last one never, as nothing reads the state after
    it), each turn with its own generator seeded by the sampling's seed; ``cached``: the
    prompt tokens the state held before this turn's prompt was fed."""
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    finish = "length"
    while len(tokens) < sampling.max_tokens:
        token, logprob, margin = pick(state.logits, sampling, generator)
        tokens.append(token)
        logprobs.append(logprob)
        margins.append(margin)
        if token in eos and not sampling.ignore_eos:
            finish = "eos"
            break
        if len(tokens) < sampling.max_tokens:
            state.advance(model, [token])
    return Turn(tokens, logprobs, margins, cached, finish)


class StateRollout:
    """A rollout stack over a loaded model's boundary states (``lm``: a
    :class:`~kvreplay.model.reading.LoadedModel` or one with its interface). Conversations
    run one after another (no shared batches). With ``reuse`` a later turn continues the
    live state of the earlier ones (the last answer token and the follow-up fed as one
    chunk, as a prefix-cache hit recomputes the tail it does not hold); without, each
    turn's whole prompt is prefilled in one shot."""

    reports = ("raw", "processed")
    batches = False

    def __init__(self, lm: Any, name: str):
        self.lm, self.name = lm, name
        self.eos = eos_ids(lm.tokenizer, lm.model.generation_config)

    def reset_cache(self) -> None:
        """Nothing is kept between conversations: every one starts from an empty state."""

    def _fresh(self, ids: Sequence[int]) -> Any:
        state = self.lm.empty_state("prefill")
        state.advance(self.lm.model, list(ids))
        return state

    def sample(self, conversations: Sequence[Conversation], reuse: bool) -> list[list[Turn]]:
        return [self._converse(c, reuse) for c in conversations]

    def _converse(self, conversation: Conversation, reuse: bool) -> list[Turn]:
        context = list(conversation.prompt_ids)
        state, cached = self._fresh(context), 0
        turns = [decode_turn(state, self.lm.model, conversation.sampling, self.eos, cached)]
        for followup in conversation.followups:
            pending = [turns[-1].token_ids[-1], *followup]
            context += [*turns[-1].token_ids, *followup]
            if reuse:
                state.advance(self.lm.model, pending)
            else:
                state = self._fresh(context)
            cached = len(context) - len(pending) if reuse else 0
            turns.append(decode_turn(state, self.lm.model, conversation.sampling, self.eos, cached))
        return turns


def scored(logits: torch.Tensor, token_ids: Sequence[int]) -> Scored:
    """A teacher-forced pass's record from the logits at each scored position (row i
    predicts ``token_ids[i]``): the raw log-probability of each token (log-softmax in
    fp32 of the logits as computed), the top-1/top-2 gap, and where the argmax differs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    picked = logprobs.gather(1, ids[:, None])[:, 0]
    top = torch.topk(logprobs, 2, dim=-1)
    argmax = top.indices[:, 0].tolist()
    return Scored(
        [float(x) for x in picked.tolist()],
        [float(x) for x in (top.values[:, 0] - top.values[:, 1]).tolist()],
        [[i, int(a)] for i, (a, t) in enumerate(zip(argmax, token_ids, strict=True)) if a != t],
    )


class ReplayScorer:
    """Teacher forcing in the live schedule (the prompt in one chunk, then each token
    alone): the same computation as :class:`StateRollout`'s first turn, so the pair that
    must agree bit for bit."""

    def __init__(self, lm: Any, name: str):
        self.lm, self.name = lm, name

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        state = self.lm.empty_state("replay")
        state.advance(self.lm.model, list(prompt_ids))
        rows = [state.logits]
        for token in token_ids[:-1]:
            state.advance(self.lm.model, [token])
            rows.append(state.logits)
        return scored(torch.stack(rows), token_ids)
