"""A battery row read back (issue 50), with no engine: a shape detects at its own level
(bits: a reported log-probability that parts; tokens: only a token), a hit that read
other cached tokens than its history wrote or a miss that read any is a detection
whatever the numbers, a shape that did not run never detects, and the calibration misses
name a phantom hit and, where they part, a stack that is not deterministic."""

from __future__ import annotations

from typing import Any

from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.trajectory import Segment, Trajectory
from kvreplay.experiments.battery.outcome import (
    CALIBRATION,
    FIELD,
    ShapeOutcome,
    calibration,
    miss_arm,
    shape_outcomes,
)
from kvreplay.harness.rows import ArmResult, PanelRow, ReplicaGate, ServedReport, replica_name
from kvreplay.verify.outcome import battery_outcome

TOKENS = [5, 6, 7]


def arm(digests: list[str], cached: int, tokens: list[int] = TOKENS, expected: int | None = None
        ) -> ArmResult:  # fmt: skip
    suffix = Trajectory([Segment("battery", [], list(tokens), "cap", [1.0] * 3, digests)])
    return ArmResult(
        construction="cache-hit", cache_fingerprint=None, logits_fingerprint=digests[0],
        boundary_argmax=tokens[0], suffix=suffix, suffix_sha256=sha256_tokens(tokens),
        post_decode_cache_len=10,
        served=ServedReport([cached], [], expected_cached_tokens=expected),
    )  # fmt: skip


SAME = ["a", "b", "c"]


def row(shapes: dict[str, tuple[str, ArmResult, ArmResult]], misses: tuple[int, int] = (0, 0),
        again: list[str] = SAME) -> PanelRow:  # fmt: skip
    arms = {CALIBRATION: arm(SAME, misses[0]), replica_name(CALIBRATION): arm(again, misses[1])}
    entries = []
    for name, (level, hit, miss) in shapes.items():
        arms |= {name: hit, miss_arm(name): miss}
        entries.append({"shape": name, "level": level, "exercised": True, "note": None})
    first = next(iter(shapes))
    return PanelRow(
        "i0", "fp32", {}, arms, {CALIBRATION: ReplicaGate(None, True)}, None, None, None,
        (first, miss_arm(first)), fields={FIELD: {"compared": [first, miss_arm(first)],
                                                  "shapes": entries}},
    )  # fmt: skip


def test_a_shape_detects_at_its_own_level() -> None:
    parted = arm(["a", "x", "c"], 8, expected=8)  # a reported logprob parts, no token
    battery = row({"warm": ("bits", parted, arm(SAME, 0)),
                   "twin": ("tokens", parted, arm(SAME, 0))})  # fmt: skip
    warm, twin = shape_outcomes(battery)
    assert warm.detected and warm.why() == "reported log-probabilities part from step 1"
    assert not twin.detected and twin.detected_at("bits")
    outcome = battery_outcome(battery)
    assert outcome.detected == ("warm",) and outcome.bits == "differ" and outcome.replicas_ok


def test_a_hit_or_miss_that_read_other_cached_tokens_is_a_detection() -> None:
    salted = row({"salted": ("bits", arm(SAME, 32, expected=0), arm(SAME, 0))})
    (shape,) = shape_outcomes(salted)
    assert shape.detected and shape.why() == "its hit read 32 cached tokens where 0 were written"
    stale = row({"warm": ("tokens", arm(SAME, 8, expected=8), arm(SAME, 4))})
    assert shape_outcomes(stale)[0].why() == "its miss read 4 cached tokens after a reset"


def test_a_shape_that_did_not_run_never_detects() -> None:
    skipped = ShapeOutcome("preempted", "bits", False, "no pool", None, None, None)
    assert not skipped.ran and not skipped.detected and skipped.tokens_equal


def test_the_calibration_names_a_phantom_hit_and_a_stack_that_is_not_deterministic() -> None:
    shapes: dict[str, tuple[str, Any, Any]] = {"warm": ("bits", arm(SAME, 8, expected=8),
                                                        arm(SAME, 0))}  # fmt: skip
    phantom = row(shapes, misses=(0, 8))
    assert calibration(phantom) == (True, 8)
    outcome = battery_outcome(phantom)
    assert outcome.detected == ("reset",) and outcome.replicas_ok
    assert outcome.shapes[0]["why"] == "a miss read 8 cached tokens after a reset"
    drifting = battery_outcome(row(shapes, again=["a", "b", "z"]))
    assert not drifting.replicas_ok and drifting.detected == ()
