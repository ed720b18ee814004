"""``kvreplay mismatch LOGGED`` (design: logged rollouts): the metrics of rollouts a
framework logged (a JSONL file, or a folder of prime-rl's or NeMo-RL's dumps), read a
rollout at a time; their decomposition where an engine side is given or rescored; their
trend by step; and a verdict where an expectation is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvreplay.core.options import option
from kvreplay.core.outputs import Outputs
from kvreplay.engines.placement import MAX_THREADS
from kvreplay.engines.threads import DEFAULT_THREADS
from kvreplay.experiments.rollout import (
    LOGGED_TRAINER,
    MismatchBounds,
    MismatchExpectation,
    Rescorer,
    judge,
    measure,
    mismatch_json,
    mismatch_junit,
    mismatch_screen,
    parse_expectation,
    plain,
    read_logged,
    summary_lines,
)
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.run.outputs import write_outputs


@dataclass(frozen=True)
class LoggedRequest:
    """What ``kvreplay mismatch LOGGED.jsonl`` is asked, each option declared once."""

    rescore_with: str | None = field(
        default=None,
        metadata=option(
            "--rescore",
            "Score the responses with the rollout engine's own one-shot prefill "
            "(BACKEND:PRECISION, e.g. vllm:bf16), splitting the total into terms.",
        ),
    )
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=option("--model", "The model that sampled the rollouts (for --rescore)."),
    )
    expect: str | None = field(
        default=None,
        metadata=option(
            "--expect", "Gate: every token's two log-probabilities the same float.",
            choices=("bitwise",),
        ),
    )  # fmt: skip
    bounds: MismatchBounds = field(default_factory=MismatchBounds)
    json_path: Path | None = field(
        default=None,
        metadata=option(
            "--json", "Write the verdict (with a gate) or the claims as JSON.", output="file"
        ),
    )
    junit_path: Path | None = field(
        default=None,
        metadata=option("--junit", "Write JUnit XML: one test case per rollout.", output="file"),
    )
    threads: int = field(
        default=DEFAULT_THREADS,
        metadata=option(
            "--threads", "torch threads of the rescoring engine.", minimum=1, maximum=MAX_THREADS
        ),
    )


def analyze_logged(path: Path, request: LoggedRequest, echo: Callable[[str], None]) -> int:
    """``kvreplay mismatch LOGGED.jsonl``: the metrics (and, with an engine side, the
    decomposition) of logged rollouts, and a verdict where an expectation is given;
    the exit code (0 without an expectation, else the verdict's)."""
    gate = request.expect is not None or request.bounds.given
    expectation = (
        parse_expectation(request.expect, request.bounds) if gate else MismatchExpectation()
    )
    outputs = Outputs.reading(path, request.model if request.rescore_with else None)
    outputs.file("--json", request.json_path)
    outputs.file("--junit", request.junit_path)
    rollouts = read_logged(path)
    if request.rescore_with is not None:
        rollouts = map(Rescorer(request.rescore_with, request.model), rollouts)
    verdict = judge(measure(rollouts, LOGGED_TRAINER), LOGGED_TRAINER, expectation, "rollout")
    for line in summary_lines(verdict.claims):
        echo(line)
    if gate:
        echo(mismatch_screen(verdict))
    data = mismatch_json(verdict) if gate else plain(verdict.claims)
    write_outputs((data, mismatch_junit(verdict)), request.json_path, request.junit_path)
    return verdict.exit_code if gate else 0
