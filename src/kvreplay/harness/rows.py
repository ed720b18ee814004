"""Typed results of a row: each continued arm, each replica's gate, the labels of two
arms, and the panel row that holds them. ``rows.jsonl`` stores their ``to_dict`` and
every reader (CSV, summary, selection) rebuilds them with ``from_dict``, so replica
integrity, exactness and the first divergence are each derived here, once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.core.comparison import Comparison, as_written, first_divergence
from kvreplay.core.scoring import pair_labels
from kvreplay.core.trajectory import Trajectory

# What a row records of its prefix (design: prefix P), beside its arms.
PREFIX_FIELDS = (
    "prefix_token_ids",
    "prompt_token_count",
    "prefix_token_count",
    "prefix_sha256",
    "prefix_reached",
    "prefix_reason",
    "prefix_stages",
)


REPLICA = "_replica"


def replica_name(arm: str) -> str:
    """The name of an arm's replica (design: replica), as rows and the paper's CSVs
    spell it."""
    return arm + REPLICA


def is_replica(name: str) -> bool:
    return name.endswith(REPLICA)


@dataclass
class ServedReport:
    """What a serving engine reported for a served arm, in place of the K/V it does not
    expose: cached context tokens per request, the first step's top logprobs
    (``[token, logprob]``, best first), the cached tokens its cache condition implies
    (every full block of the P a hit's rewrite computed; 0 for a miss; None for a
    request from the prompt), whether the arm's own generation of P reproduced it, and
    the items whose requests shared its batches. An arm continued from a state written
    into an engine's blocks (design: block K/V) reports the tokens of P those blocks
    cover as its expected cached tokens, and ``blocks_read``: its first request read
    exactly the blocks written (the hit guard). A hit served after unrelated prompts
    overwrote part of P (``evicted_tokens`` of them), or beside background traffic,
    reads what survived, at most what was written: ``read`` names how much. ``load`` is
    what was in flight while an arm under background traffic ran
    (:class:`~kvreplay.backends.traffic.Load`). ``stages_reset``: every request of the arm
    was served from a reset cache (a miss at every stage), so none may read a cached
    token."""

    cached_tokens: list[int]
    first_logprobs: list[list[Any]]
    expected_cached_tokens: int | None = None
    prefix_reproduced: bool | None = None
    companions: list[str] | None = None
    blocks_read: bool | None = None
    evicted_tokens: int | None = None
    load: dict[str, Any] | None = None
    stages_reset: bool | None = None

    @property
    def condition_met(self) -> bool | None:
        """The engine served the first request as the arm's cache condition says (and,
        where every stage was served from a reset cache, every request)."""
        if self.expected_cached_tokens is None:
            return None
        if self.stages_reset:
            return not any(self.cached_tokens)
        if self.evicted_tokens is not None or self.load is not None:
            # after an eviction or beside traffic (which can evict too): what survived
            return 0 <= self.cached_tokens[0] <= self.expected_cached_tokens
        hit = self.cached_tokens[0] == self.expected_cached_tokens
        return hit and self.blocks_read is not False

    @property
    def read(self) -> str | None:
        """How much of what the arm's history wrote its first request read: ``all``,
        ``part`` or ``none`` (a "hit" that read none was a miss); None for a miss."""
        if not self.expected_cached_tokens:
            return None
        cached = self.cached_tokens[0]
        return "all" if cached >= self.expected_cached_tokens else "part" if cached else "none"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServedReport:
        return cls(**data)


@dataclass
class ArmResult:
    """One continued state (design: an arm): its boundary fingerprints, the suffix it
    decoded, and that suffix's score. ``reused_from`` names the row whose identical
    computation supplied the suffix; ``snapshot`` is the saved boundary state, if any.
    A served arm (a backend without K/V access) has no cache fingerprint; ``served``
    holds what the engine reported instead (cached tokens per request, first-step top
    logprobs)."""

    construction: str
    cache_fingerprint: str | None
    logits_fingerprint: str
    boundary_argmax: int
    suffix: Trajectory
    suffix_sha256: str
    post_decode_cache_len: int
    answer: str | None = None
    answer_parsed: bool = False
    correct: bool = False
    snapshot: dict[str, str] | None = None
    reused_from: str | None = None
    served: ServedReport | None = None

    @property
    def suffix_token_ids(self) -> list[int]:
        return self.suffix.token_ids

    @property
    def first_step_margin(self) -> float | None:
        """Top-1 minus top-2 logit at the first decoded token, as recorded."""
        margins = self.suffix.segments[0].margins
        return margins[0] if margins else None

    def margin_at(self, index: int | None) -> float | None:
        """The top-1/top-2 margin of the step that decoded suffix token ``index``; None
        for a forced opener token or no index."""
        if index is None:
            return None
        position = 0
        for segment in self.suffix.segments:
            position += len(segment.opener_ids)
            if index < position:
                return None
            if index < position + len(segment.token_ids):
                return round(segment.margins[index - position], 6)
            position += len(segment.token_ids)
        return None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "construction": self.construction,
            "cache_fingerprint": self.cache_fingerprint,
            "logits_fingerprint": self.logits_fingerprint,
            "boundary_argmax": self.boundary_argmax,
            "suffix": self.suffix.to_dict(),
            "suffix_token_ids": self.suffix_token_ids,
            "suffix_sha256": self.suffix_sha256,
            "post_decode_cache_len": self.post_decode_cache_len,
            "answer": self.answer,
            "answer_parsed": self.answer_parsed,
            "correct": self.correct,
        }
        if self.snapshot is not None:
            data["snapshot"] = self.snapshot
        if self.reused_from is not None:
            data["reused_from"] = self.reused_from
        if self.served is not None:
            data["served"] = self.served.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArmResult:
        return cls(
            construction=data["construction"],
            cache_fingerprint=data["cache_fingerprint"],
            logits_fingerprint=data["logits_fingerprint"],
            boundary_argmax=data["boundary_argmax"],
            suffix=Trajectory.from_dict(data["suffix"]),
            suffix_sha256=data["suffix_sha256"],
            post_decode_cache_len=data["post_decode_cache_len"],
            answer=data["answer"],
            answer_parsed=data["answer_parsed"],
            correct=data["correct"],
            snapshot=data.get("snapshot"),
            reused_from=data.get("reused_from"),
            served=ServedReport.from_dict(data["served"]) if "served" in data else None,
        )


@dataclass(frozen=True)
class ReplicaGate:
    """The integrity gate of a replica: bit-equal state and, when the replica was
    continued, no shared storage and the same suffix. A *clone* is a replica that is
    checked but not continued (the bridge's): it has no storage or suffix verdict. A
    served replica (no K/V access) has no cache or storage verdict; it must instead read
    as many cached tokens as its arm (the same cache condition) and rewrite the same
    prefix before a hit."""

    cache_exact: bool | None
    logits_exact: bool
    storage_disjoint: bool | None = None
    suffix_exact: bool | None = None
    cached_tokens_equal: bool | None = None
    prefix_rewrites_exact: bool | None = None
    cache_condition_met: bool | None = None  # served: the hit hit and the miss missed

    @classmethod
    def served(cls, arm: list[ArmResult], replica: list[ArmResult]) -> ReplicaGate:
        """A served replica's gate, from what its arm and it recorded over the seeds it
        continued (one, unless resampled): the run derives it so, and so does an audit."""
        pairs = list(zip(arm, replica, strict=False))
        reports = [r.served for r in arm + replica if r.served is not None]
        reproduced = [r.prefix_reproduced for r in reports]
        return cls(
            cache_exact=None,
            logits_exact=all(a.logits_fingerprint == r.logits_fingerprint for a, r in pairs),
            suffix_exact=all(a.suffix_sha256 == r.suffix_sha256 for a, r in pairs),
            cached_tokens_equal=all(
                a.served is not None
                and r.served is not None
                and a.served.cached_tokens == r.served.cached_tokens
                for a, r in pairs
            ),
            prefix_rewrites_exact=None if None in reproduced else all(reproduced),
            cache_condition_met=all(r.condition_met is not False for r in reports),
        )

    @property
    def is_clone(self) -> bool:
        return self.suffix_exact is None

    @property
    def passed(self) -> bool:
        return all(v for v in asdict(self).values() if v is not None)

    def to_dict(self) -> dict[str, bool]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, bool]) -> ReplicaGate:
        return cls(**{"cache_exact": None, **data})  # a served gate stores no cache verdict


@dataclass(frozen=True)
class PairLabels:
    """Equality labels of two continued arms, and where their suffixes first part."""

    suffix_equal: bool
    trace_equal: bool
    merge_equal: bool
    answer_equal: bool
    first_suffix_divergence_index: int | None

    @classmethod
    def of(cls, left: ArmResult, right: ArmResult) -> PairLabels:
        labels = pair_labels(left.suffix, right.suffix, left.answer, right.answer)
        index = first_divergence(left.suffix_token_ids, right.suffix_token_ids)
        return cls(**labels, first_suffix_divergence_index=index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PanelRow:
    """A completed row of arms over one prefix (design: one executor runs any declared
    panel into one of these). ``compared`` names the two arms the row is about; an
    experiment's own fields (its source, panel entry, probes) stay in ``fields``. A
    resampled panel keeps each arm's seeded continuations, in seed order, in ``samples``
    instead of ``arms``. States held in an engine's blocks cover only P's full blocks:
    ``block_kv`` says how many tokens of P they cover, which the K/V comparison and
    fingerprints are over, and how many after them every hit recomputes."""

    item_id: str
    precision: str
    prefix: dict[str, Any]
    arms: dict[str, ArmResult]
    replicas: dict[str, ReplicaGate]
    comparison: Comparison | None  # None where the row keeps only boundary_argmax_equal
    functional_state_equal: bool | None  # None: a served row, with no states to compare
    all_storage_disjoint: bool | None
    compared: tuple[str, str]
    all_layers_transplanted: bool | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    block_kv: dict[str, int] | None = None  # states in an engine's blocks: what they cover
    samples: dict[str, list[ArmResult]] = field(default_factory=dict)

    @property
    def left(self) -> ArmResult:
        return self.arms[self.compared[0]]

    @property
    def right(self) -> ArmResult:
        return self.arms[self.compared[1]]

    @property
    def pairs(self) -> list[tuple[ArmResult, ArmResult]]:
        """The compared arms' continuations side by side: one pair, or one per seed."""
        if self.samples:
            left, right = self.compared
            return list(zip(self.samples[left], self.samples[right], strict=True))
        return [(self.left, self.right)]

    @property
    def labels(self) -> PairLabels:
        return PairLabels.of(self.left, self.right)

    @property
    def boundary_argmax_equal(self) -> bool:
        """The compared arms would decode the same first token."""
        if self.comparison is not None:
            return self.comparison.boundary_argmax_equal
        return self.left.boundary_argmax == self.right.boundary_argmax

    @property
    def diverges(self) -> bool:
        return self.left.suffix_sha256 != self.right.suffix_sha256

    @property
    def replicas_exact(self) -> bool:
        return all(gate.passed for gate in self.replicas.values())

    @property
    def integrity_pass(self) -> bool:
        """Every replica gate, equal cache shapes, no shared storage, full transplants,
        and every arm an engine served under its cache condition."""
        served = [arm.served for arm in self.arms.values() if arm.served is not None]
        return (
            self.replicas_exact
            and self.functional_state_equal is not False
            and self.all_storage_disjoint is not False
            and self.all_layers_transplanted is not False
            and all(report.condition_met is not False for report in served)
        )

    def to_dict(self) -> dict[str, Any]:
        """The row as ``rows.jsonl`` holds it. Continued replicas sit under
        ``replicas``; clones sit beside the arms as ``<arm>_clone``."""
        data: dict[str, Any] = {
            "item_id": self.item_id,
            "precision": self.precision,
            "status": "ok",
            **self.prefix,
            **self.fields,
            "arms": {name: arm.to_dict() for name, arm in self.arms.items()},
            **(
                {"samples": {n: [s.to_dict() for s in arms] for n, arms in self.samples.items()}}
                if self.samples
                else {}
            ),
            "functional_state_equal": self.functional_state_equal,
            "all_storage_disjoint": self.all_storage_disjoint,
        }
        for name, gate in self.replicas.items():
            if gate.is_clone:
                data[f"{name}_clone"] = gate.to_dict()
            else:
                data.setdefault("replicas", {})[name] = gate.to_dict()
        if self.comparison is not None:
            data["comparison"] = self.comparison.to_dict()
        if self.all_layers_transplanted is not None:
            data["all_layers_transplanted"] = self.all_layers_transplanted
        if self.block_kv is not None:
            data["block_kv"] = self.block_kv
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], compared: tuple[str, str]) -> PanelRow:
        arms = {name: ArmResult.from_dict(arm) for name, arm in data["arms"].items()}
        samples = {
            name: [ArmResult.from_dict(s) for s in arm]
            for name, arm in data.get("samples", {}).items()
        }
        replicas = {k: ReplicaGate.from_dict(v) for k, v in data.get("replicas", {}).items()}
        replicas |= {
            name: ReplicaGate.from_dict(data[f"{name}_clone"])
            for name in arms
            if f"{name}_clone" in data
        }
        known = {"item_id", "precision", "status", "arms", "samples", "replicas", "comparison"}
        known |= {"functional_state_equal", "all_storage_disjoint", "all_layers_transplanted"}
        known |= {"block_kv"}
        known |= {f"{name}_clone" for name in arms}
        return cls(
            item_id=data["item_id"],
            precision=data["precision"],
            prefix={k: data[k] for k in PREFIX_FIELDS if k in data},
            arms=arms,
            replicas=replicas,
            comparison=Comparison.from_dict(data["comparison"]) if "comparison" in data else None,
            functional_state_equal=data["functional_state_equal"],
            all_storage_disjoint=data["all_storage_disjoint"],
            compared=compared,
            all_layers_transplanted=data.get("all_layers_transplanted"),
            block_kv=data.get("block_kv"),
            fields={k: v for k, v in data.items() if k not in known and k not in PREFIX_FIELDS},
            samples=samples,
        )


def without_unrecorded_digests(fresh: Any, recorded: Any) -> Any:
    """A re-executed row as its recording could hold it: step digests dropped from every
    segment whose recording has none (a row written before kvreplay recorded them). Such
    a row's bits level is unknown, never equal (:mod:`kvreplay.verify.verdict`), so dropping
    them cannot turn a forgery into a pass."""
    if isinstance(fresh, dict) and isinstance(recorded, dict):
        kept = {
            k: without_unrecorded_digests(v, recorded.get(k))
            for k, v in fresh.items()
            if k != "digests" or "digests" in recorded or "token_ids" not in recorded
        }
        return kept
    if isinstance(fresh, list) and isinstance(recorded, list):
        return [
            without_unrecorded_digests(f, r) for f, r in zip(fresh, recorded, strict=False)
        ] + fresh[len(recorded) :]
    return fresh


def row_as_written(data: dict[str, Any]) -> dict[str, Any]:
    """A recorded row as kvreplay writes it now, which a re-execution is compared with:
    its comparison without the retired null field (:func:`~kvreplay.core.comparison.as_written`)."""
    if isinstance(data.get("comparison"), dict):
        return {**data, "comparison": as_written(data["comparison"])}
    return data
