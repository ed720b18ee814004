"""What a completed row says of itself, re-derived from the row alone, with no model:
``kvreplay audit`` checks it on every row, and sampling limits only re-execution.

A row records fields derived from others it also records: each arm's suffix hash and
token list from its stages' tokens, its answer and correctness from its final stage
scored against the item's answer, the pair's labels from the compared arms, each
replica's gate from the arm and the replica, the comparison's exactness from the two
states' fingerprints, the prefix's hash and count from its tokens. A forger who edits
one field and leaves what derives from it contradicts the row, and is named here. What
no row can show without re-execution (that the tokens are the model's) is the sample's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvreplay.core.canonical import sha256_json
from kvreplay.core.scoring import score
from kvreplay.harness.rows import ArmResult, PairLabels, PanelRow, ReplicaGate, replica_name


@dataclass(frozen=True)
class Scorer:
    """Scores a suffix as the run did: the run's tokenizer and extractor, and each
    item's answer (None for items the audit could not read)."""

    tokenizer: Any
    extractor: str
    answers: dict[str, str] | None

    def outcome(self, arm: ArmResult, item_id: str) -> dict[str, Any] | None:
        if self.answers is None or item_id not in self.answers:
            return None
        found = score(self.tokenizer, arm.suffix, self.answers[item_id], self.extractor)
        return {"answer": found["extracted"], "answer_parsed": found["parsed"],
                "correct": found["correct"]}  # fmt: skip


def row_problems(data: dict[str, Any], row: PanelRow | None, scorer: Scorer | None) -> list[str]:
    """Each field of a row (``data`` as recorded; ``row`` typed, for a completed row)
    that is not what the row's other fields derive; ``scorer`` None skips the scoring."""
    problems = _prefix_problems(data)
    if row is None:
        return problems
    for path, raw, arm in _arms(data, row):
        problems += _arm_problems(path, raw, arm, row.item_id, scorer)
    if isinstance(data.get("labels"), dict) and row.arms:
        problems += _differs("labels", data["labels"], PairLabels.of(row.left, row.right).to_dict())
    for name, gate in row.replicas.items():
        problems += _gate_problems(name, gate, row)
    if row.comparison is not None and row.arms:
        left, right = row.left, row.right
        derived: dict[str, Any] = {
            "logits.exact": left.logits_fingerprint == right.logits_fingerprint,
            "boundary_argmax_equal": left.boundary_argmax == right.boundary_argmax,
        }
        if left.cache_fingerprint is not None and right.cache_fingerprint is not None:
            derived["cache.exact"] = left.cache_fingerprint == right.cache_fingerprint
        comparison = row.comparison  # read in place: to_dict copies every layer's numbers
        recorded = {
            "logits.exact": comparison.logits.get("exact"),
            "boundary_argmax_equal": comparison.boundary_argmax_equal,
            "cache.exact": comparison.cache.get("exact"),
        }
        problems += [
            f"field comparison.{path} is not what the compared arms' fingerprints and argmax say"
            for path, value in derived.items()
            if recorded[path] != value
        ]
    return problems


def _prefix_problems(data: dict[str, Any]) -> list[str]:
    ids = data.get("prefix_token_ids")
    if not isinstance(ids, list):
        return []
    problems = []
    if "prefix_sha256" in data and data["prefix_sha256"] != sha256_json(ids):
        problems.append("field prefix_sha256 is not the hash of prefix_token_ids")
    if "prefix_token_count" in data and data["prefix_token_count"] != len(ids):
        problems.append("field prefix_token_count is not the length of prefix_token_ids")
    return problems


def _arms(data: dict[str, Any], row: PanelRow) -> Iterator[tuple[str, dict[str, Any], ArmResult]]:
    """Every continued arm as recorded and typed, with its path in the row."""
    for name, arm in row.arms.items():
        yield f"arms.{name}", data["arms"][name], arm
    for name, seeds in row.samples.items():
        for index, arm in enumerate(seeds):
            yield f"samples.{name}[{index}]", data["samples"][name][index], arm


def _arm_problems(
    path: str, raw: dict[str, Any], arm: ArmResult, item_id: str, scorer: Scorer | None
) -> list[str]:
    tokens = arm.suffix.token_ids
    derived: dict[str, Any] = {"suffix_token_ids": tokens, "suffix_sha256": sha256_json(tokens)}
    outcome = scorer.outcome(arm, item_id) if scorer is not None else None
    problems = [
        f"field {path}.{name} is not what its suffix's stages derive"
        for name, value in derived.items()
        if raw.get(name) != value
    ]
    if outcome is not None:
        problems += [
            f"field {path}.{name} is not what its suffix scores against the item's answer"
            for name, value in outcome.items()
            if raw.get(name) != value
        ]
    return problems


def _gate_problems(name: str, gate: ReplicaGate, row: PanelRow) -> list[str]:
    """A replica's gate against what its arm and the replica recorded: the served gate
    whole; an in-process gate's exactness, whose fingerprints are of bit-exact states."""
    arms = row.samples.get(name) or ([row.arms[name]] if name in row.arms else [])
    copies = row.samples.get(replica_name(name)) or [
        row.arms[n] for n in [replica_name(name)] if n in row.arms
    ]
    if not arms or not copies:
        return []  # a clone: checked, never continued, so it has no record of its own
    if any(a.served is not None for a in arms):
        derived = ReplicaGate.served(arms, copies).to_dict()
    else:
        pairs = list(zip(arms, copies, strict=False))

        def every(of: Callable[[ArmResult], Any]) -> bool:
            return all(of(a) == of(r) for a, r in pairs)

        derived = {
            "suffix_exact": every(lambda a: a.suffix_sha256),
            "logits_exact": every(lambda a: a.logits_fingerprint),
            "cache_exact": every(lambda a: a.cache_fingerprint),
        }
    recorded = gate.to_dict()
    return _differs(
        f"replicas.{name}", recorded, {k: v for k, v in derived.items() if k in recorded}
    )


def _differs(path: str, recorded: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    return [
        f"field {path}.{key} is not what the row's arms derive"
        for key, value in derived.items()
        if recorded.get(key) != value
    ]
