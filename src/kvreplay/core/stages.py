"""Stage plans: how a generation is cut into stages, where the boundary is, and how
stops and forced openers are handled.

A plan is data (it goes into the manifest verbatim); :class:`StopDetector` watches a
stage's tokens without re-decoding the whole sequence at each step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.core.errors import KvreplayError


@dataclass(frozen=True)
class Stage:
    """One stage: a content cap, stop strings, and an optional teacher-forced opener."""

    name: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    opener: str = ""

    def __post_init__(self) -> None:
        """Every plan, built-in, from a file or from Python, is checked here."""
        if not isinstance(self.name, str) or not self.name:
            raise KvreplayError("Every stage needs a non-empty string 'name'.")
        where = f"Stage {self.name!r}"
        if not _positive_int(self.max_new_tokens):
            raise KvreplayError(f"{where}: 'max_new_tokens' must be an integer of at least 1.")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise KvreplayError(f"{where}: 'stop' must be a list of non-empty strings.")
        if not isinstance(self.opener, str):
            raise KvreplayError(f"{where}: 'opener' must be a string.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class StagePlan:
    """Ordered stages; the boundary is the end of stage ``boundary`` (an index)."""

    name: str
    stages: tuple[Stage, ...]
    boundary: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise KvreplayError("A stage plan's 'name' must be a non-empty string.")
        if not self.stages:
            raise KvreplayError("A stage plan needs at least one stage.")
        if not isinstance(self.boundary, int) or isinstance(self.boundary, bool):
            raise KvreplayError("A stage plan's 'boundary' must be a stage index (an integer).")
        if not 0 <= self.boundary < len(self.stages) - 1:
            raise KvreplayError(
                f"The boundary must end one of the first {len(self.stages) - 1} stages "
                "so that a suffix follows it."
            )
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise KvreplayError("Stage names in a plan must be unique.")

    @property
    def prefix_stages(self) -> tuple[Stage, ...]:
        return self.stages[: self.boundary + 1]

    @property
    def suffix_stages(self) -> tuple[Stage, ...]:
        return self.stages[self.boundary + 1 :]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "boundary": self.boundary,
            "boundary_stage": self.stages[self.boundary].name,
            "stages": [asdict(s) for s in self.stages],
        }

    @classmethod
    def from_dict(cls, data: Any) -> StagePlan:
        """A plan from JSON data; the types are checked, never coerced (a string ``stop``
        is not split into characters, ``0.5`` is not a boundary)."""
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise KvreplayError("A stage plan must be an object with a list 'stages'.")
        stages = []
        for index, entry in enumerate(data["stages"]):
            if not isinstance(entry, dict):
                raise KvreplayError(f"Stage {index} of the plan must be an object.")
            stop = entry.get("stop", [])
            if not isinstance(stop, list | tuple):
                raise KvreplayError(
                    f"Stage {entry.get('name', index)!r}: 'stop' must be a list of strings."
                )
            stages.append(
                Stage(
                    name=entry.get("name"),  # type: ignore[arg-type]  # checked by Stage
                    max_new_tokens=entry.get("max_new_tokens"),  # type: ignore[arg-type]
                    stop=tuple(stop),
                    opener=entry.get("opener", ""),
                )
            )
        return cls(
            name=data.get("name", "custom"), stages=tuple(stages), boundary=data.get("boundary", 0)
        )


# The embedded instruct model has no think tags, so the boundary is cut mid-reasoning
# after a fixed budget; the suffix (trace continuation, then a forced answer) is long
# enough (~100 tokens) for bf16 drift to surface, which short suffixes never showed.
BUILTIN_PLANS: dict[str, StagePlan] = {
    "instruct": StagePlan(
        name="instruct",
        stages=(
            Stage("think", max_new_tokens=32),
            Stage("trace", max_new_tokens=88),
            Stage("answer", max_new_tokens=10, stop=("\n",), opener="\nFinal answer:"),
        ),
    ),
    "reasoning": StagePlan(
        name="reasoning",
        stages=(
            Stage("think", max_new_tokens=2048, stop=("</think>",)),
            Stage("answer", max_new_tokens=512, opener="\n\nAnswer:"),
        ),
    ),
    "short": StagePlan(
        name="short",
        stages=(
            Stage("think", max_new_tokens=6),
            Stage("trace", max_new_tokens=10),
            Stage("answer", max_new_tokens=4, opener="\nFinal answer:"),
        ),
    ),
}


def get_plan(name: str) -> StagePlan:
    if name not in BUILTIN_PLANS:
        raise KvreplayError(
            f"Unknown stage plan {name!r}; choose one of {', '.join(BUILTIN_PLANS)}."
        )
    return BUILTIN_PLANS[name]


def load_plan(spec: str) -> StagePlan:
    """A built-in plan by name, or a plan file (``.json``)."""
    from pathlib import Path

    from kvreplay.core.jsonio import read_json

    path = Path(spec)
    if path.suffix != ".json":
        return get_plan(spec)
    data = read_json(path, f"the stage plan file {path}")
    try:
        return StagePlan.from_dict(data)
    except KvreplayError as exc:
        raise KvreplayError(f"The stage plan file {path} is not a valid plan: {exc}") from exc


def plan_budget(plan: StagePlan, tokenizer: Any) -> int:
    """The most tokens a plan adds to a prompt: every stage at its cap, with its opener."""
    return sum(stage.max_new_tokens + len(opener_ids(tokenizer, stage)) for stage in plan.stages)


@dataclass
class StopDetector:
    """Detects a stage's stop strings on a sliding window of its newest tokens.

    Each token decodes to at least one character for the tokenizers we support, so a
    window of ``len(longest stop) + 2`` tokens always contains any stop that ended on the
    newest token; decoding only that window keeps the cost per step constant.
    """

    tokenizer: Any
    stops: tuple[str, ...]
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self._window = max((len(s) for s in self.stops), default=0) + 2

    def hit(self, tokens: list[int]) -> str | None:
        """Return the stop reason if the newest token ends the stage, else None."""
        if tokens and tokens[-1] in self.stop_token_ids:
            return "eos"
        if not self.stops or not tokens:
            return None
        tail = self.tokenizer.decode(tokens[-self._window :], skip_special_tokens=False)
        for stop in self.stops:
            # Checked after every token, so a stop not involving the newest token
            # would already have fired one step earlier.
            if stop in tail:
                return f"stop:{stop}"
        return None


def opener_ids(tokenizer: Any, stage: Stage) -> list[int]:
    """Token ids of a stage's opener; an opener that tokenizes to nothing is an error."""
    if not stage.opener:
        return []
    ids = tokenizer.encode(stage.opener, add_special_tokens=False)
    if not ids:
        raise KvreplayError(f"The opener of stage {stage.name!r} tokenizes to nothing.")
    return list(ids)


def eos_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """EOS ids from the tokenizer and the model's generation config (either may name
    one id, several or none)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return frozenset(ids)
