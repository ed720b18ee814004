"""Served panels (design: backend): the arms of a row on a backend without K/V access.

A serving engine with automatic prefix caching answers a staged generation's next
request from the K/V blocks that earlier requests wrote, prompt prefill *and decode
steps*; only the tail block is recomputed. That is the serving form of live vs prefill:

- ``hit``: the cache is reset, the prefix stages are generated again (rewriting P's
  blocks exactly as the first generation did), then P is sent as a new request;
- ``miss``: the cache is reset and P is sent: a one-shot prefill of P;
- ``uninterrupted``: one request decodes from the prompt straight through the boundary,
  the truest live state a serving engine has (only where no opener or stop string sits
  at the boundary);
- a ``companions`` arm is a hit whose every request shares the batch with other items'
  requests (the paper's batch-composition control);
- a ``traffic`` arm runs while loopback clients send other prompts to the server
  (``--traffic N``, :mod:`kvreplay.backends.traffic`); its row records the load;
- a hit's ``history`` says which requests wrote the P blocks it reads: ``decode``, the
  generation that decoded through P (the hit above); ``warm``, one earlier one-shot
  prefill of P; ``evicted``, the decoding generation followed by unrelated prompts that
  overwrote part of P's blocks (the guard then records what the hit actually read).

Every request of a hit after the first is served as the engine would serve a
multi-turn conversation: from the blocks the arm itself wrote. A miss is a miss at every
stage (:data:`EVERY_STAGE`): each of its requests is served from a reset cache, a one-shot
prefill of its whole context, so a defect that changes every hit alike cannot change
both compared arms alike. A run recorded before that (its config names no ``miss``)
served a miss's later stages from the blocks its first request wrote, and re-executes
so. A resampled panel serves
each arm once per seed (the engine's per-request seeded sampler), each from a reset
cache. :func:`run_served_panel` is the executor; declarations are data, as for
:func:`~kvreplay.harness.executor.run_panel`.

A replica is its arm served again under the same condition; where the engine can save
and load back the state an arm's requests left (``ServedModel.restores``: llama.cpp's
slot files), the hit's replica continues from that state restored in place instead
(``cache-hit-restored``): a copy of the live state, as an in-process replica is.

Integrity: a replica must reproduce its arm's suffix, first-step logprobs (bit for bit)
and cached-token counts; a hit must read every full block of the P its rewrite computed
(and the rewrite must reproduce P), a miss none.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from kvreplay.contract.config import RunConfig
from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.items import encode_prompt
from kvreplay.core.sampler import Sampler
from kvreplay.core.scoring import score
from kvreplay.core.stages import Stage, StagePlan
from kvreplay.core.trajectory import Prefix, Segment, Trajectory
from kvreplay.harness.panel import Panel, Replica
from kvreplay.harness.prefixes import prefix_record, prompt_ids
from kvreplay.harness.requests import computed_tokens, generate_prefix, serve_stages
from kvreplay.harness.rows import ArmResult, PanelRow, ReplicaGate, ServedReport, replica_name
from kvreplay.harness.units import Clock, Unit, Workbench

if TYPE_CHECKING:
    from kvreplay.backends.served import ServedModel
    from kvreplay.harness.panel import Panel, Replica

MISS = "miss"
"""The key of a served experiment's config, and of its units' inputs, that says how a
miss arm serves its stages after the first (absent in a run recorded before it)."""
EVERY_STAGE = "every-stage"
"""Each request of a miss arm served from a reset cache."""

Condition = Literal["hit", "miss", "uninterrupted"]
History = Literal["decode", "warm", "evicted"]


@dataclass(frozen=True)
class ServedArm:
    """A declared served arm: its cache condition, whether it has a replica served
    under the same condition (``replica`` or ``none``), whether its requests share
    batches with companions, which history wrote a hit's blocks, and whether it runs
    under background traffic."""

    name: str
    condition: Condition
    replica: Replica = "replica"
    companions: bool = False
    history: History = "decode"
    traffic: bool = False

    @property
    def construction(self) -> str:
        name = "uninterrupted" if self.condition == "uninterrupted" else f"cache-{self.condition}"
        if self.history != "decode":
            name = f"{name}-{self.history}"
        if self.traffic:
            name = f"{name}-traffic"
        return f"{name}-batched" if self.companions else name


def miss_input(config: dict[str, Any]) -> dict[str, Any]:
    """A unit's input that says how its miss arms serve later stages, from the run's
    recorded config (None for a run recorded before: from their own blocks)."""
    return {MISS: config.get(MISS)}


def straight_through(plan: StagePlan, prefix: Prefix) -> bool:
    """A single request can decode through the boundary: one prefix stage without opener
    or stop strings that ran to its cap (an EOS would end the request there), and a
    first suffix stage without opener or stop strings."""
    first = plan.suffix_stages[0]
    (only, *more) = plan.prefix_stages
    ran_to_cap = prefix.segments[0].stop_reason == "cap"
    return (
        not more
        and not only.opener
        and not only.stop
        and ran_to_cap
        and not (first.opener or first.stop)
    )


def _uninterrupted(
    served: ServedModel, ids: list[int], prefix: Prefix, plan: StagePlan, sampler: Sampler
) -> tuple[list[Segment], ServedReport]:
    """One request from the prompt through the boundary and the first suffix stage,
    then the remaining suffix stages from what it wrote."""
    from kvreplay.backends.served import Request

    boundary, first = plan.prefix_stages[0], plan.suffix_stages[0]
    through = Stage(first.name, boundary.max_new_tokens + first.max_new_tokens)
    straight = served.serve([Request(ids, through, sampler)])[0]
    segment = straight.segment
    cut = len(prefix.token_ids) - prefix.prompt_len
    head = Segment(
        first.name,
        [],
        segment.token_ids[cut:],
        segment.stop_reason,
        segment.margins[cut:],
        segment.digests[cut:],
    )
    rest, report = serve_stages(
        served, ids + segment.token_ids, plan.suffix_stages[1:], sampler, first_opener_fed=False
    )
    steps = straight.steps[cut:]
    return [head, *rest], ServedReport(
        cached_tokens=[straight.cached_tokens, *report.cached_tokens],
        first_logprobs=[[t, lp] for t, lp in steps[0]] if steps else [],
        prefix_reproduced=ids + segment.token_ids[:cut] == prefix.token_ids,
    )


def serve_arm(
    served: ServedModel,
    arm: ServedArm,
    ids: list[int],
    prefix: Prefix,
    config: RunConfig,
    sampler: Sampler,
    companions: Sequence[list[int]],
    restored: bool = False,
    miss_every_stage: bool = False,
) -> tuple[list[Segment], ServedReport]:
    """One arm under its cache condition, from a reset cache; ``sampler`` is the arm's
    (a resampled arm's seed), the prefix rewrite uses the run's. ``restored``: a hit
    continues from its rewritten state saved and loaded back; ``miss_every_stage``: a
    miss serves each stage from a reset cache."""
    served.reset_cache()
    plan = config.plan
    if arm.condition == "uninterrupted":
        return _uninterrupted(served, ids, prefix, plan, sampler)
    reproduced, expected, evicted = None, 0, None
    if arm.condition == "hit" and arm.history == "warm":
        _warm(served, prefix, config.sampler)
        expected = config.backend.expected_hit(len(prefix.token_ids) - 1)
    elif arm.condition == "hit":
        reproduced = generate_prefix(served, ids, plan, config.sampler).token_ids == (
            prefix.token_ids
        )
        expected = config.backend.expected_hit(computed_tokens(prefix))
        if arm.history == "evicted":
            evicted = served.evict(computed_tokens(prefix), str(config.sampler.seed))
        if restored:
            served.round_trip()
    reset = arm.condition == "miss" and miss_every_stage
    segments, report = serve_stages(
        served,
        prefix.token_ids,
        plan.suffix_stages,
        sampler,
        first_opener_fed=True,
        companions=companions if arm.companions else (),
        reset=reset,
    )
    report.prefix_reproduced, report.expected_cached_tokens = reproduced, expected
    report.stages_reset = reset or None
    report.evicted_tokens = evicted
    return segments, report


def _warm(served: ServedModel, prefix: Prefix, sampler: Sampler) -> None:
    """A one-shot prefill of P (a request for one token): what a warm cache holds."""
    from kvreplay.backends.served import Request

    served.serve([Request(list(prefix.token_ids), Stage("warm", 1), sampler)])


def _arm_result(
    worker: Workbench,
    served: ServedModel,
    unit: Unit,
    arm: ServedArm,
    served_arm: tuple[list[Segment], ServedReport],
    prefix: Prefix,
    companions: list[str],
    construction: str,
) -> ArmResult:
    from kvreplay.backends.served import logprobs_fingerprint

    segments, report = served_arm
    suffix = Trajectory(segments)
    first = segments[0].token_ids
    outcome = score(served.tokenizer, suffix, unit.item.answer, worker.config.extractor)
    return ArmResult(
        construction=construction,
        cache_fingerprint=None,
        logits_fingerprint=logprobs_fingerprint(report.first_logprobs),
        boundary_argmax=first[0] if first else -1,
        suffix=suffix,
        suffix_sha256=sha256_tokens(suffix.token_ids),
        post_decode_cache_len=len(prefix.token_ids) + len(suffix.token_ids) - 1,
        answer=outcome["extracted"],
        answer_parsed=outcome["parsed"],
        correct=outcome["correct"],
        served=replace(report, companions=companions if arm.companions else None),
    )


def run_served_panel(
    worker: Workbench, unit: Unit, clock: Clock, panel: Panel[ServedArm]
) -> tuple[PanelRow | None, dict[str, Any]]:
    """Serve every declared arm (and replica) over one generated prefix; the row is None
    when generation did not reach the boundary."""
    served = worker.served(unit.precision)
    config = worker.config
    ids = prompt_ids(worker, served, unit.item)
    with clock.model():
        served.reset_cache()
        prefix = generate_prefix(served, ids, config.plan, config.sampler)
    record = prefix_record(prefix)
    if not prefix.reached:
        return None, record
    mates = unit.inputs.get("companions", [])
    companion_ids = [encode_prompt(served.tokenizer, m["prompt"], config.chat) for m in mates]
    companions = [m["item_id"] for m in mates]
    others = [
        encode_prompt(served.tokenizer, m["prompt"], config.chat)
        for m in unit.inputs.get("traffic", [])
    ]
    clients = config.backend.traffic_clients
    every_stage = unit.inputs.get(MISS) == EVERY_STAGE
    results: dict[str, list[ArmResult]] = {}
    for arm in panel.arms:
        if arm.condition == "uninterrupted" and not straight_through(config.plan, prefix):
            continue
        if (arm.companions and not mates) or (arm.traffic and not clients):
            continue
        for name in [arm.name] + ([replica_name(arm.name)] if arm.replica == "replica" else []):
            restored = name != arm.name and arm.condition == "hit" and served.restores
            construction = f"{arm.construction}-restored" if restored else arm.construction
            seeds = panel.samples.of(name) if panel.samples else (config.sampler.seed,)
            results[name] = []
            for seed in seeds:
                sampler = replace(config.sampler, seed=seed)
                with clock.model(), ExitStack() as stack:
                    background = f"{unit.item.id}:{seed}"  # the traffic's own seed
                    traffic = (
                        stack.enter_context(served.traffic(clients, background, others))
                        if arm.traffic
                        else None
                    )
                    run = serve_arm(
                        served, arm, ids, prefix, config, sampler, companion_ids, restored,
                        every_stage,
                    )  # fmt: skip
                if traffic is not None:
                    run[1].load = traffic.load.to_dict()
                results[name].append(
                    _arm_result(worker, served, unit, arm, run, prefix, companions, construction)
                )
    gates = {
        arm.name: ReplicaGate.served(results[arm.name], results[replica_name(arm.name)])
        for arm in panel.arms
        if arm.replica == "replica"
    }
    row = PanelRow(
        item_id=unit.item.id,
        precision=unit.precision,
        prefix=record,
        arms={} if panel.samples else {name: runs[0] for name, runs in results.items()},
        samples=results if panel.samples else {},
        replicas=gates,
        comparison=None,
        functional_state_equal=None,
        all_storage_disjoint=None,
        compared=panel.compared,
        fields={"backend": config.backend.name},
    )
    return row, record
