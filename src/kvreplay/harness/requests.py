"""A plan's stages served as requests, one per stage, each from what the requests
before it left in the engine's prefix cache (as a multi-turn conversation is served),
and how many of P's tokens such a generation computed. Served panels
(:mod:`kvreplay.harness.served`) and states held in an engine's blocks
(:mod:`kvreplay.harness.blocks`) both serve stages this way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import Stage, StagePlan, opener_ids
from kvreplay.core.trajectory import Prefix, Segment, Trajectory, generated_prefix
from kvreplay.harness.rows import ServedReport

if TYPE_CHECKING:
    from kvreplay.backends.served import ServedModel


def serve_stages(
    served: ServedModel,
    context: list[int],
    stages: Sequence[Stage],
    sampler: Sampler,
    first_opener_fed: bool,
    companions: Sequence[list[int]] = (),
    reset: bool = False,
) -> tuple[list[Segment], ServedReport]:
    """Serve ``stages`` in order from ``context``, one request per stage, each sharing
    its batch with a request per companion prompt: their segments, and the report of
    the cached tokens per request and the first step's top logprobs. With ``reset``
    every request after the first is served from a reset cache too (a miss at every
    stage: a one-shot prefill of its whole context), not from the blocks the requests
    before it wrote."""
    from kvreplay.backends.served import Request

    segments: list[Segment] = []
    report = ServedReport(cached_tokens=[], first_logprobs=[])
    for index, stage in enumerate(stages):
        forced = opener_ids(served.tokenizer, stage)
        if not (index == 0 and first_opener_fed):
            context = context + forced
        if reset and index:
            served.reset_cache()
        requests = [Request(context, stage, sampler, tuple(forced))]
        requests += [Request(list(c), stage, sampler) for c in companions]
        result = served.serve(requests)[0]
        segments.append(result.segment)
        report.cached_tokens.append(result.cached_tokens)
        if not report.first_logprobs and result.steps:
            report.first_logprobs = [[t, lp] for t, lp in result.steps[0]]
        context = context + result.segment.token_ids
    return segments, report


def generate_prefix(
    served: ServedModel, ids: list[int], plan: StagePlan, sampler: Sampler
) -> Prefix:
    """P as the engine generates it from the prompt ``ids``: the prefix stages served in
    turn, and the first suffix stage's opener."""
    segments, _ = serve_stages(served, ids, plan.prefix_stages, sampler, first_opener_fed=False)
    next_opener = opener_ids(served.tokenizer, plan.suffix_stages[0])
    return generated_prefix(ids, Trajectory(segments), plan, next_opener)


def computed_tokens(prefix: Prefix) -> int:
    """The tokens the prefix rewrite computed, which a hit must read back (as much of them
    as the backend caches, ``Backend.expected_hit``): the prompt and each prefix stage's
    stream, less the last generated token, which was sampled but never fed; the next
    stage's opener is not among them."""
    return prefix.prompt_len + len(Trajectory(prefix.segments).token_ids) - 1
