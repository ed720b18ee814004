"""The vllm backend's rollout side (design: rollout stack, scorer): vLLM's engine in this
process as a rollout stack and as a scorer of its own.

Sampling is vLLM's own (seeded per request), and the log-probability of each sampled
token is the one the engine reports: vLLM's ``logprobs_mode`` (the engine kvreplay
starts keeps vLLM's default, ``raw_logprobs``: the log-softmax in fp32 of the logits
before temperature, penalties, logits processors and top-k/top-p). Turns sampled with
reuse are successive requests whose prompts hit the prefix-cache blocks the earlier
turns' prefill and decode wrote (full blocks; the engine reports the cached tokens).

The engine's own prefill is a request for the whole sequence with ``prompt_logprobs``:
vLLM never reads the prefix cache for such a request (its sampling parameters set
``skip_reading_prefix_cache``), so it is one-shot prefill of every token (the engine
prefills up to ``max_num_batched_tokens`` in one chunk). Its ``replay`` schedule
forces the tokens through the decode path (:class:`~kvreplay.backends.vllm.blocks.ForcedTokens`,
which acts after the raw log-probabilities are computed), one step per token. Imports
vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm import SamplingParams

from kvreplay.backends.http.vllm_server import DTYPE_NAMES
from kvreplay.backends.vllm.blocks import FORCED
from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.rollout import Conversation, Scored, Turn

REPORTS = "raw_logprobs"  # the logprobs_mode of the engine kvreplay starts (vLLM's default)
TOP = 2  # log-probabilities asked for per step: the top two give the gap
FINISH = {"length": "length", "stop": "eos"}
Step = tuple[list[tuple[int, float]], dict[int, float]]  # top log-probs in rank order, all


def _ranked(step: dict[int, Any]) -> Step:
    """A step's log-probabilities: the top ones in rank order, and every one by token."""
    values = {int(t): float(lp.logprob) for t, lp in step.items()}
    ranked = sorted(((lp.rank, int(t)) for t, lp in step.items() if lp.rank is not None))
    return [(t, values[t]) for rank, t in ranked if rank <= TOP], values


def _generate(served: Any, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    try:
        return served.engine.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
    except Exception as exc:  # noqa: BLE001 - the engine's kernels raise many kinds
        raise KvreplayError(
            f"The vLLM engine failed on a request ({type(exc).__name__}: {first_line(exc)})."
        ) from exc


class VllmRollout:
    """vLLM's engine sampling conversations together: each turn of every conversation
    is one request of one ``generate`` call, so they share the engine's batches."""

    batches = True

    def __init__(self, served: Any, name: str):
        self.served, self.name = served, name
        mode = served.engine.llm_engine.model_config.logprobs_mode
        if mode != REPORTS:
            raise KvreplayError(
                f"vLLM's engine reports {mode}, not {REPORTS}, which the vllm backend "
                "promises (its rollout_logprobs)."
            )

    def reset_cache(self) -> None:
        self.served.reset_cache()

    def _params(self, conversation: Conversation) -> SamplingParams:
        return sampling_params(conversation, self.served.eos_token_ids)

    def sample(self, conversations: Sequence[Conversation], reuse: bool) -> list[list[Turn]]:
        turns: list[list[Turn]] = [[] for _ in conversations]
        contexts = [list(c.prompt_ids) for c in conversations]
        for index in range(max(c.turns for c in conversations)):
            live = [i for i, c in enumerate(conversations) if index < c.turns]
            if index:
                for i in live:
                    previous = turns[i][-1].token_ids
                    contexts[i] += [*previous, *conversations[i].followups[index - 1]]
                if not reuse:
                    self.reset_cache()
            outputs = _generate(
                self.served,
                [contexts[i] for i in live],
                [self._params(conversations[i]) for i in live],
            )
            for i, output in zip(live, outputs, strict=True):
                turns[i].append(turn_of(output))
        return turns


def sampling_params(conversation: Conversation, eos: frozenset[int]) -> SamplingParams:
    """vLLM's sampling parameters for a conversation's turn (seeded, its top two
    log-probabilities reported at every step)."""
    s = conversation.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=None if s.greedy else s.seed,
        max_tokens=s.max_tokens,
        ignore_eos=s.ignore_eos,
        stop_token_ids=[] if s.ignore_eos else sorted(eos),
        logprobs=TOP,
        detokenize=False,
    )


def turn_of(output: Any) -> Turn:
    """A request's output as the turn a rollout stack reports."""
    completion = output.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    steps = [_ranked(step) for step in completion.logprobs or []]
    if len(steps) != len(tokens):
        raise KvreplayError(
            f"vLLM returned {len(tokens)} tokens but log-probabilities for {len(steps)}."
        )
    logprobs = [values[t] for t, (_, values) in zip(tokens, steps, strict=True)]
    margins = [top[0][1] - top[1][1] for top, _ in steps]
    finish = FINISH.get(str(completion.finish_reason), str(completion.finish_reason))
    return Turn(tokens, logprobs, margins, int(output.num_cached_tokens or 0), finish)


class VllmPrefill:
    """The engine's one-shot prefill of the whole sequence, with prompt log-probabilities."""

    def __init__(self, served: Any, name: str):
        self.served, self.name = served, name

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP, detokenize=False)
        (output,) = _generate(self.served, [[*prompt_ids, *token_ids]], [params])
        steps = [_ranked(step) for step in output.prompt_logprobs[len(prompt_ids) :]]
        return _scored(steps, token_ids)


class VllmReplay:
    """The tokens forced through the engine's decode path, one step each after the
    prompt's prefill: the live schedule, as the rollout decoded them."""

    def __init__(self, served: Any, name: str):
        self.served, self.name = served, name

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> Scored:
        params = SamplingParams(
            max_tokens=len(token_ids),
            temperature=0,
            ignore_eos=True,
            stop_token_ids=[],
            logprobs=TOP,
            detokenize=False,
            extra_args={FORCED: list(token_ids)},
        )
        self.served.reset_cache()
        (output,) = _generate(self.served, [list(prompt_ids)], [params])
        completion = output.outputs[0]
        if [int(t) for t in completion.token_ids] != list(token_ids):
            raise KvreplayError("vLLM's engine did not take the tokens it was forced to take.")
        return _scored([_ranked(step) for step in completion.logprobs], token_ids)


def _scored(steps: list[Step], tokens: Sequence[int]) -> Scored:
    pairs = list(zip(steps, tokens, strict=True))
    return Scored(
        [values[t] for (_, values), t in pairs],
        [top[0][1] - top[1][1] for (top, _), _ in pairs],
        [[i, top[0][0]] for i, ((top, _), t) in enumerate(pairs) if top[0][0] != t],
    )


def _precision(served: Any) -> str:
    dtype = str(served.engine.llm_engine.model_config.dtype)
    return DTYPE_NAMES.get(dtype, dtype)


def rollout_stack(served: Any) -> VllmRollout:
    return VllmRollout(served, f"vllm:{_precision(served)}")


def scorer(served: Any, schedule: str) -> VllmPrefill | VllmReplay:
    name = f"vllm:{_precision(served)} {schedule}"
    return VllmPrefill(served, name) if schedule == "prefill" else VllmReplay(served, name)
