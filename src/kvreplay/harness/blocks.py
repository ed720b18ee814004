"""Boundary states that are a serving engine's cached blocks (design: block K/V; the
vllm backend's model holds such an ``engine``): how the panels build, generate and
continue them. Such a state advances only by the engine's own requests, so these take
the place of :mod:`kvreplay.model.construct`'s chunks and :mod:`kvreplay.model.decode`'s token loop,
which every other model keeps:

- ``live``: the prefix stages generated from a reset cache, one request per stage, as a
  served hit's rewrite generates them; P's blocks as that generation wrote them (the
  prompt's prefill and the decode steps): the blocks a prefix-cache hit reads.
- ``replay``: the same requests with every generated token forced (teacher forcing
  through the decode path), so each block is computed on the schedule live computed it
  on: the engine's token-by-token rebuild.
- ``prefill``: one request for P from a reset cache: a miss's one-shot prefill.

A state covers the full blocks of the tokens its generation computed (P less the last
generated token and the next stage's opener, as a served hit's guard counts them; a
recorded prefix without stages: P less its last token). Its continuation is a hit on
its blocks written back into the engine, and reports whether the hit read exactly them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvreplay.core.comparison import first_divergence
from kvreplay.core.errors import KvreplayError
from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import StagePlan
from kvreplay.core.trajectory import Prefix, Segment, Trajectory
from kvreplay.harness.requests import computed_tokens, generate_prefix, serve_stages
from kvreplay.harness.rows import ServedReport

if TYPE_CHECKING:
    from kvreplay.backends.vllm.blocks import BlockEngine, BlockState
    from kvreplay.model.state import BoundaryState

# The in-process constructions and decode loop are imported where they run (torch): the
# panels that call these are declared without torch (kvreplay.harness.panel).

ENGINE_CONSTRUCTIONS = ("replay", "prefill")  # and live, generated rather than rebuilt


def engine_of(lm: Any) -> BlockEngine | None:
    """The engine whose cached blocks hold ``lm``'s states; None for an in-process model."""
    return getattr(lm, "engine", None)


def _covered(engine: BlockEngine, prefix: Prefix) -> int:
    computed = computed_tokens(prefix) if prefix.segments else len(prefix.token_ids) - 1
    return engine.covered(computed)


def _replay(engine: BlockEngine, prefix: Prefix) -> None:
    """The live schedule's requests, each decoding its recorded tokens by force."""
    context = prefix.token_ids[: prefix.prompt_len]
    generated = prefix.token_ids[prefix.prompt_len :]
    segments = prefix.segments or [Segment("", [], generated, "")]
    for segment in segments:
        context = context + segment.opener_ids
        if segment.token_ids:
            engine.force(context, segment.token_ids)
        context = context + segment.token_ids
    if not any(s.token_ids for s in segments):
        engine.prefill(prefix.token_ids)  # nothing after the prompt: one chunk, as in replay


def build_state(lm: Any, prefix: Prefix, construction: str) -> BoundaryState:
    """A rebuilt boundary state over ``prefix`` (:func:`kvreplay.model.construct.build`)."""
    engine = engine_of(lm)
    if engine is None:
        from kvreplay.model.construct import build

        return build(lm, prefix, construction)
    if construction not in ENGINE_CONSTRUCTIONS:
        raise KvreplayError(
            f"An engine's cached blocks are built by live, replay or prefill, not {construction}."
        )
    if lm.context_length and len(prefix.token_ids) > lm.context_length:
        raise KvreplayError(
            f"The prefix ({len(prefix.token_ids)} tokens) exceeds the engine's context window "
            f"of {lm.context_length} tokens."
        )
    engine.reset()
    if construction == "prefill":
        engine.prefill(prefix.token_ids)
    else:
        _replay(engine, prefix)
    return engine.read(prefix.token_ids, _covered(engine, prefix), construction)


def live_state(
    lm: Any, prompt_ids: list[int], plan: StagePlan, sampler: Sampler
) -> tuple[BoundaryState, Prefix]:
    """The state a generation reaches P with, and P (:func:`kvreplay.model.construct.live`)."""
    from kvreplay.model.construct import check_fits, live

    engine = engine_of(lm)
    if engine is None:
        return live(lm, prompt_ids, plan, sampler)
    check_fits(lm, len(prompt_ids), plan)
    engine.reset()
    prefix = generate_prefix(engine.served, list(prompt_ids), plan, sampler)
    return engine.read(prefix.token_ids, _covered(engine, prefix), "live"), prefix


def continue_state(
    lm: Any, state: BoundaryState, plan: StagePlan, sampler: Sampler
) -> tuple[Trajectory, ServedReport | None]:
    """Continue a state through the plan's suffix stages; an engine's state continues as
    a hit on its blocks, and the engine's report says what the hit read. The state is
    consumed: it then runs through every suffix token fed, as a continued state does."""
    engine = engine_of(lm)
    if engine is None:
        from kvreplay.model.decode import continue_from

        return continue_from(lm, state, plan, sampler), None
    block_state: BlockState = state  # type: ignore[assignment] - an engine's model's state
    written = engine.install(block_state)
    segments, report = serve_stages(
        engine.served, state.token_ids, plan.suffix_stages, sampler, first_opener_fed=True
    )
    report.expected_cached_tokens = block_state.covered
    report.blocks_read = engine.holds(block_state, written)
    suffix = Trajectory(segments)
    state.token_ids.extend(suffix.token_ids[:-1])
    return suffix, report


def follow_in_engine(
    lm: Any, state: BoundaryState, reference: Trajectory, plan: StagePlan, sampler: Sampler
) -> int | None:
    """:func:`kvreplay.experiments.localize.follow` in an engine: the state continued in
    full (a request is not stopped at a token it did not expect), and the index of the
    first suffix token it decodes otherwise than ``reference``, or None."""
    suffix, report = continue_state(lm, state, plan, sampler)
    assert report is not None, "an engine's continuation reports what it read"
    if not report.condition_met:
        raise KvreplayError("vLLM's continuation did not read the transplanted blocks.")
    return first_divergence(reference.token_ids, suffix.token_ids)
