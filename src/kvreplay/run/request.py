"""What a user asks ``kvreplay run`` (and ``check``) for, typed, with every shared option
declared once on its field (design: every option declared once): the command line
builds its options from these fields (:mod:`kvreplay.core.options`), and a command that
asks for other defaults (a check, an experiment that samples by nature) says which.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.contract.config import RunSettings
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import BUILTIN_ITEMS
from kvreplay.core.options import COUNTS, bounds, check_bounds, option
from kvreplay.core.outputs import check_run_folder
from kvreplay.core.paths import check_name
from kvreplay.core.scoring import get_extractor
from kvreplay.core.stages import BUILTIN_PLANS, StagePlan, load_plan
from kvreplay.engines.placement import Placement
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.model.precision import parse_device, parse_dtypes
from kvreplay.model.sources import canonical_spec


def split_precisions(value: Any) -> tuple[str, ...]:
    """``--dtypes`` as given (``bf16,fp32``): precisions some backend runs, each once;
    the run's backend refuses those it does not run."""
    from kvreplay.backends import precisions

    names = value.split(",") if isinstance(value, str) else value
    return parse_dtypes((v.strip() for v in names if v.strip()), precisions())


def spell_precisions(value: tuple[str, ...]) -> str:
    return ",".join(value)


@dataclass(frozen=True, kw_only=True)
class RunOptions(RunSettings):
    """The options every run command shares, beside the backend's own settings."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata=option(
            "--model", "Embedded model name, local folder, GGUF file, or cached hub id."
        ),
    )
    items: str = field(
        default="arith",
        metadata=option(
            "--items", f"Built-in item set ({', '.join(BUILTIN_ITEMS)}) or a JSONL file."
        ),
    )
    n: int | None = field(
        default=None,
        metadata=option("--n", "How many items (default: all).", **bounds(COUNTS)),
    )
    dtypes: tuple[str, ...] = field(
        default=("bf16", "fp32"),
        metadata=option(
            "--dtypes",
            "Comma-separated precisions: fp32, bf16, fp16 (llamacpp: KV-cache types, also q8_0).",
            parse=split_precisions,
            spell=spell_precisions,
        ),
    )
    plan: str = field(
        default="instruct",
        metadata=option(
            "--plan", f"Built-in stage plan ({', '.join(BUILTIN_PLANS)}) or a plan .json."
        ),
    )
    save_snapshots: bool = field(
        default=False,
        metadata=option(
            "--save-snapshots", "Also save boundary states as safetensors (large for big models)."
        ),
    )
    placement: Placement = field(default_factory=Placement)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", canonical_spec(self.model))

    def stage_plan(self) -> StagePlan:
        """The plan ``plan`` names: a built-in one, or a plan file."""
        return load_plan(self.plan)

    def check(self) -> None:
        """Refuse, before anything is read or written, options that cannot run together:
        precisions the backend does not run, a device this machine lacks, a placement
        that cannot be made, workers on a backend whose workers would share a server;
        and every number within its declared bounds (a request built in Python too)."""
        check_bounds(self)
        parse_dtypes(self.dtypes, self.backend.precisions)
        parse_device(self.device)
        self.placement.check(self.device)
        get_extractor(self.extractor)
        if self.placement.workers > 1 and not self.backend.parallel_workers:
            raise KvreplayError(
                f"The {self.backend.name} backend's workers would share one server and reset "
                "each other's prefix cache; run it with --workers 1."
            )


@dataclass(frozen=True, kw_only=True)
class RunRequest(RunOptions):
    """What the user asked ``kvreplay run EXPERIMENT`` for; every field is validated
    before model work starts."""

    experiment: str
    out: Path
    prefix_from: Path | None = None  # the run --from reads (an experiment's own option)
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    extra: dict[str, Any] = field(default_factory=dict)  # the experiment's own options

    def check(self) -> None:
        """The shared options, and the run folder as an output (design: output writer):
        not a link, a device or a file, not in a kernel folder or a model folder the run
        reads, in a folder that takes files."""
        check_name(self.out, "--out")
        check_run_folder(self.out, (self.items, self.plan, self.model))
        super().check()
