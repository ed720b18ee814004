"""The one per-unit executor of in-process panels (loads torch): :func:`run_panel`
builds a panel's arms (:mod:`kvreplay.harness.panel`), checks, continues and scores
them into a typed :class:`~kvreplay.harness.rows.PanelRow`, in the spirit of
TransformerLens's ``patching.py``: one generic function, thin named declarations.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvreplay.backends.hf.loading import LoadedModel
from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.sampler import Sampler
from kvreplay.core.scoring import score
from kvreplay.harness.blocks import build_state, continue_state, engine_of, live_state
from kvreplay.harness.panel import Arm, Panel
from kvreplay.harness.prefixes import prefix_from_inputs, prefix_record, prompt_ids
from kvreplay.harness.rows import ArmResult, PanelRow, ReplicaGate, replica_name
from kvreplay.harness.units import Clock, Unit, Workbench
from kvreplay.model.state import (
    BoundaryState,
    ReplicaCheck,
    clone,
    compare,
    make_replica,
    save_state,
    storage_disjoint,
    transplant,
)


@dataclass
class PanelOutcome:
    """What :func:`run_panel` returns: the row (None when live generation did not reach
    the boundary), the prefix as rows record it, the model, and for the experiment's own
    probes the boundary states (as built: kept intact only with ``keep_states``) and
    the boundary cache length."""

    row: PanelRow | None
    prefix: dict[str, Any]
    lm: LoadedModel
    states: dict[str, BoundaryState] = field(default_factory=dict)
    boundary_cache_len: int = 0


def snapshot(
    worker: Workbench, unit: Unit, arm: str, state: BoundaryState
) -> dict[str, str] | None:
    """Save a boundary state when the run asked for snapshots; return its file entry."""
    if not worker.config.save_snapshots:
        return None
    from kvreplay.model.identity import file_digests

    # Readable, and unique: ids that differ only in unsafe characters (x/y, x_y) differ
    # in the digest of the row key.
    key = str(unit.key)
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
    tag = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    path = Path(worker.config.run_dir) / "snapshots" / f"{readable}-{tag}-{arm}.safetensors"
    save_state(state, path, {"row": key, "arm": arm})
    return {
        "file": f"snapshots/{path.name}",
        "sha256": file_digests(path.parent, [path])[path.name],
    }


def run_arm(
    worker: Workbench,
    lm: LoadedModel,
    unit: Unit,
    arm: str,
    state: BoundaryState,
    clock: Clock,
    reuse: dict[str, Any] | None = None,
    sampler: Sampler | None = None,
) -> ArmResult:
    """Fingerprint a boundary state, continue it to the end, and score the suffix.

    The state is consumed; fingerprints are taken before it advances. ``reuse`` is an
    earlier arm of this run with the same model, dtype, construction and prefix: when its
    cache and logits fingerprints equal this state's, greedy continuation is provably the
    same computation, so its suffix is taken instead of decoding again. ``sampler``
    replaces the run's own (a resampled arm's seed).
    """
    sampler = sampler or worker.config.sampler
    boundary = (state.construction, state.cache_fingerprint(), state.logits_fingerprint())
    argmax = state.argmax()
    saved = snapshot(worker, unit, arm, state)
    earlier = ArmResult.from_dict(reuse["arm"]) if reuse else None
    if reuse and earlier and sampler.greedy and boundary == _boundary(earlier):
        suffix, suffix_sha256, served = earlier.suffix, earlier.suffix_sha256, earlier.served
        cache_len, reused_from = earlier.post_decode_cache_len, reuse["key"]
    else:
        with clock.model():
            suffix, served = continue_state(lm, state, worker.config.plan, sampler)
        suffix_sha256, cache_len = sha256_tokens(suffix.token_ids), state.position
        reused_from = None
    outcome = score(lm.tokenizer, suffix, unit.item.answer, worker.config.extractor)
    return ArmResult(
        *boundary,
        boundary_argmax=argmax,
        suffix=suffix,
        suffix_sha256=suffix_sha256,
        post_decode_cache_len=cache_len,
        answer=outcome["extracted"],
        answer_parsed=outcome["parsed"],
        correct=outcome["correct"],
        snapshot=saved,
        reused_from=reused_from,
        served=served,
    )


def _boundary(arm: ArmResult) -> tuple[str, str, str]:
    return arm.construction, arm.cache_fingerprint, arm.logits_fingerprint


def functional_state_equal(states: list[BoundaryState]) -> bool:
    """Every state covers the same tokens with the same per-layer lengths, shapes and dtypes."""
    first = states[0]
    signature = [(k.shape, k.dtype, v.shape, v.dtype) for k, v in first.layer_tensors()]
    return all(
        s.token_ids == first.token_ids
        and s.layer_lengths() == first.layer_lengths()
        and [(k.shape, k.dtype, v.shape, v.dtype) for k, v in s.layer_tensors()] == signature
        for s in states[1:]
    )


def holds_donor(result: BoundaryState, donor: BoundaryState) -> bool:
    """Every layer's K and V of ``result`` is bit-equal to the donor's (a full transplant)."""
    return all(
        a.equal(b)
        for pair_a, pair_b in zip(result.layer_tensors(), donor.layer_tensors(), strict=True)
        for a, b in zip(pair_a, pair_b, strict=True)
    )


def _construct(
    worker: Workbench, lm: LoadedModel, unit: Unit, panel: Panel[Arm], clock: Clock
) -> tuple[dict[str, BoundaryState], dict[str, Any]]:
    """Every arm's boundary state over one prefix: generated live when an arm is
    ``live`` (then the prefix is the generation's), else the unit's recorded prefix."""
    states: dict[str, BoundaryState] = {}
    retained = next((arm for arm in panel.arms if arm.construction == "live"), None)
    if retained is not None:
        ids = prompt_ids(worker, lm, unit.item)
        with clock.model():
            states[retained.name], prefix = live_state(
                lm, ids, worker.config.plan, worker.config.sampler
            )
        record = prefix_record(prefix)
        if not prefix.reached:
            return {}, record
    else:
        prefix = prefix_from_inputs(unit.inputs)
        # a rebuilt prefix keeps the stages of the generation that made it
        record = {**prefix_record(prefix), "prefix_stages": unit.inputs.get("prefix_stages", [])}
    for arm in panel.arms:
        if arm.name not in states:
            with clock.model():
                states[arm.name] = build_state(lm, prefix, arm.construction)
    return states, record


def _replica_suffix_exact(
    arms: dict[str, ArmResult], samples: dict[str, list[ArmResult]], arm: str
) -> bool:
    """The replica decoded what its arm did: its one suffix, or each seed it continued
    (the first seeds of its arm's)."""
    if samples:
        pairs = zip(samples[arm], samples[replica_name(arm)], strict=False)
        return all(a.suffix_sha256 == b.suffix_sha256 for a, b in pairs)
    return arms[arm].suffix_sha256 == arms[replica_name(arm)].suffix_sha256


def run_panel(worker: Workbench, unit: Unit, clock: Clock, panel: Panel[Arm]) -> PanelOutcome:
    """Build every declared arm, compare the compared pair, check every replica and the
    storage of every state against every other, then continue and score each arm."""
    lm = worker.model(unit.precision)
    states, record = _construct(worker, lm, unit, panel, clock)
    if not states:
        return PanelOutcome(None, record, lm)
    transplants = {
        t.name: transplant(states[t.donor], states[t.recipient]) for t in panel.transplants
    }
    full = [holds_donor(transplants[t.name], states[t.donor]) for t in panel.transplants]
    left, right = panel.compared
    engine = engine_of(lm)
    # What the boundary states are, before any continuation advances them.
    comparison = compare(states[left], states[right])
    block_kv = None if engine is None else engine.coverage(states[left])
    boundary_cache_len = max(states[left].layer_lengths())
    functional = functional_state_equal([*states.values(), *transplants.values()])
    continued = {n: clone(s) for n, s in states.items()} if panel.keep_states else dict(states)
    to_run, checks = _with_replicas(panel, continued)
    to_run |= transplants
    everything = list(to_run.values())
    disjoint = all(
        storage_disjoint(a, b) for i, a in enumerate(everything) for b in everything[i + 1 :]
    )
    clones = {replica_name(arm.name) for arm in panel.arms if arm.replica == "clone"}
    continuing = {name: state for name, state in to_run.items() if name not in clones}
    arms, samples = _continue_arms(worker, lm, unit, clock, panel, continuing)
    row = PanelRow(
        item_id=unit.item.id,
        precision=unit.precision,
        prefix=record,
        arms=arms,
        samples=samples,
        replicas=_gates(panel, checks, arms, samples),
        comparison=comparison,
        functional_state_equal=functional,
        all_storage_disjoint=disjoint,
        compared=panel.compared,
        all_layers_transplanted=all(full) if panel.transplants else None,
        block_kv=block_kv,
    )
    return PanelOutcome(row, record, lm, states, boundary_cache_len)


def _with_replicas(
    panel: Panel[Arm], continued: dict[str, BoundaryState]
) -> tuple[dict[str, BoundaryState], dict[str, ReplicaCheck]]:
    """Every arm's state and, where it has one, its replica's, with each replica's check."""
    to_run: dict[str, BoundaryState] = {}
    checks = {}
    for arm in panel.arms:
        to_run[arm.name] = continued[arm.name]
        if arm.replica != "none":
            replica, checks[arm.name] = make_replica(continued[arm.name])
            to_run[replica_name(arm.name)] = replica
    return to_run, checks


def _continue_arms(
    worker: Workbench,
    lm: Any,
    unit: Unit,
    clock: Clock,
    panel: Panel[Arm],
    continuing: dict[str, BoundaryState],
) -> tuple[dict[str, ArmResult], dict[str, list[ArmResult]]]:
    """Each state continued greedily once, or (a sampled panel) once per seed, each seed
    from its own copy of the state with the run's sampler reseeded."""
    reuse = unit.inputs.get("reuse", {})
    if panel.samples is None:
        arms = {
            name: run_arm(worker, lm, unit, name, state, clock, reuse.get(name))
            for name, state in continuing.items()
        }
        return arms, {}
    sampler = worker.config.sampler
    samples = {
        name: [
            run_arm(worker, lm, unit, name, clone(state), clock, sampler=replace(sampler, seed=s))
            for s in panel.samples.of(name)
        ]
        for name, state in continuing.items()
    }
    return {}, samples


def _gates(
    panel: Panel[Arm],
    checks: dict[str, ReplicaCheck],
    arms: dict[str, ArmResult],
    samples: dict[str, list[ArmResult]],
) -> dict[str, ReplicaGate]:
    """Each replica's integrity gate: bit-equal to its arm and, unless it is a clone that
    is not continued, disjoint from it and continued to the same suffix."""
    return {
        arm.name: ReplicaGate(checks[arm.name].cache_exact, checks[arm.name].logits_exact)
        if arm.replica == "clone"
        else ReplicaGate(
            checks[arm.name].cache_exact,
            checks[arm.name].logits_exact,
            checks[arm.name].storage_disjoint,
            _replica_suffix_exact(arms, samples, arm.name),
        )
        for arm in panel.arms
        if arm.replica != "none"
    }
