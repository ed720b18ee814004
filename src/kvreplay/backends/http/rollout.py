"""The http backend's rollout side (design: rollout stack, scorer, weight update arm): a
running server as a rollout stack (each turn one seeded completion from token ids, the
log-probability the server reported for each token it sampled, its ``--logprobs-mode``
read from the server), as a scorer (a request with ``prompt_logprobs``: the server's own
one-shot prefill) and as an engine whose weights a run updates (its reload route, from a
folder the new weights are written to once). Agentic RL samples through servers. Only
``vllm serve`` offers all three today (its development mode); llama-server refuses each
in one sentence. No torch but where weights are written."""

from __future__ import annotations

import hashlib
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvreplay.backends.served import Sampled
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import Conversation, Scored, Turn
from kvreplay.model.update import WeightUpdate

FINISH = {"length": "length", "stop": "eos"}
MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
"""A server's ``--logprobs-mode`` as kvreplay names the log-probability (design: which
log-probability); another mode (logits) reports no log-probability."""


def reported(mode: str | None, url: str) -> tuple[str, ...]:
    """The log-probabilities a server's rollout stack reports, or a refusal."""
    if mode not in MODES:
        said = (
            "does not say which log-probability it reports" if mode is None else f"reports {mode}"
        )
        raise KvreplayError(
            f"The server at {url} {said}, so its rollouts' log-probabilities would be "
            "ambiguous; start vllm serve in dev mode with --logprobs-mode raw_logprobs."
        )
    return (MODES[mode],)


def turn_of(sampled: Sampled) -> Turn:
    finish = FINISH.get(str(sampled.finish), str(sampled.finish))
    return Turn(sampled.tokens, sampled.logprobs, sampled.margins, sampled.cached_tokens, finish)


class HttpRollout:
    """A server sampling a conversation's turns, one request each; a later turn's prompt
    re-sends the earlier answer, so it hits the blocks the earlier turn wrote."""

    batches = False  # requests sent together are batched as the server decides

    def __init__(self, served: Any, reports: tuple[str, ...], name: str):
        self.served, self.reports, self.name = served, reports, name

    def reset_cache(self) -> None:
        self.served.reset_cache()

    def sample(self, conversations: Sequence[Conversation], reuse: bool) -> list[list[Turn]]:
        found = []
        for conversation in conversations:
            context, turns = list(conversation.prompt_ids), []
            for index in range(conversation.turns):
                if index:
                    context += [*turns[-1].token_ids, *conversation.followups[index - 1]]
                    if not reuse:
                        self.reset_cache()
                sampled = self.served.adapter.sample(
                    self.served.model,
                    context,
                    conversation.sampling,
                    sorted(self.served.eos_token_ids),
                )
                turns.append(turn_of(sampled))
            found.append(turns)
        return found


class HttpPrefill:
    """The server's own one-shot prefill of the whole sequence (prompt log-probabilities,
    which vLLM never serves from its prefix cache)."""

    def __init__(self, served: Any, name: str):
        self.served, self.name = served, name

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        steps = self.served.adapter.prompt_logprobs(self.served.model, [*prompt_ids, *token_ids])
        scored = steps[len(prompt_ids) - 1 :]
        if len(scored) != len(token_ids):
            raise KvreplayError(
                f"The server returned prompt log-probabilities for {len(scored)} of "
                f"{len(token_ids)} scored tokens."
            )
        logprobs, margins, argmax = [], [], []
        for position, (top, token) in enumerate(zip(scored, token_ids, strict=True)):
            values = dict(top)
            if token not in values:
                raise KvreplayError(
                    f"The server's prompt log-probabilities leave out the scored token {token}."
                )
            ranked = sorted(top, key=lambda pair: -pair[1])
            logprobs.append(values[token])
            margins.append(ranked[0][1] - ranked[1][1] if len(ranked) > 1 else math.inf)
            if ranked[0][0] != token:
                argmax.append([position, ranked[0][0]])
        return Scored(logprobs, margins, argmax)


class HttpUpdater:
    """A server reloading its weights in place (vLLM: ``/collective_rpc``'s
    ``reload_weights``) from a folder the new weights are written to, once per process;
    the run's own weights come back from its model folder. A request in flight cannot be
    held between two steps over HTTP: no in-flight rollout."""

    inflight = False

    def __init__(self, served: Any, model_folder: str):
        self.served, self.folder = served, Path(model_folder)
        self.written = tempfile.TemporaryDirectory(prefix="kvreplay-weights-")

    def _folder(self, weights: WeightUpdate | None) -> str:
        if weights is None:
            return str(self.folder)
        if weights.folder is not None:
            return str(Path(weights.folder).resolve())
        key = hashlib.sha256(weights.spec.encode()).hexdigest()[:16]
        return str(weights.write(self.folder, Path(self.written.name) / key))

    def sync(self, weights: WeightUpdate | None) -> None:
        self.served.adapter.reload_weights(self._folder(weights))
        self.served.reset_cache()

    def sample_inflight(self, conversation: Conversation, at: int, weights: WeightUpdate) -> Turn:
        raise KvreplayError("A server cannot update the weights of a request in flight here.")
