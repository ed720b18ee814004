"""Issue 49, item 3: every number a user can give is bounded where it is declared, and the
bounds are checked before anything runs, on the command line and on a request built in
Python. Found from the command line itself and from every option class (a new number
option without bounds fails here)."""

from __future__ import annotations

import math
from pathlib import Path

import click
import pytest
from helpers import cli_commands, cli_params

from kvreplay.audit.request import AuditRequest
from kvreplay.backends import BACKENDS, make_backend
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import Declared, every
from kvreplay.core.sampler import Sampler
from kvreplay.experiments.registry import EXPERIMENTS
from kvreplay.run.check import CheckRequest
from kvreplay.run.mismatch import LoggedRequest
from kvreplay.run.refeed import RefeedPlan
from kvreplay.run.request import RunRequest


def declared_numbers() -> list[tuple[str, Declared]]:
    """Every declared option that holds a number: the requests', every backend's and
    every experiment's own."""
    found = [
        (cls.__name__, spec)
        for cls in (RunRequest, CheckRequest, AuditRequest, LoggedRequest, RefeedPlan)
        for spec in every(cls)
    ]
    found += [(name, s) for name, cls in BACKENDS.items() for s in cls.settings().values()]
    found += [(n, s) for n, d in EXPERIMENTS.items() for s in d.option_fields().values()]
    return [(owner, spec) for owner, spec in found if spec.kind in ("int", "float")]


@pytest.mark.parametrize(("owner", "spec"), declared_numbers(), ids=lambda x: getattr(x, "flag", x))
def test_every_declared_number_has_both_bounds(owner: str, spec: Declared) -> None:
    low, high = spec.option.minimum, spec.option.maximum
    assert low is not None and high is not None, f"{owner} {spec.flag}"
    assert math.isfinite(low) and math.isfinite(high) and low <= high, f"{owner} {spec.flag}"
    if spec.default is not None:
        assert low <= spec.default <= high, f"{owner} {spec.flag}: its default is out of bounds"


def test_every_number_the_command_line_takes_is_a_bounded_range() -> None:
    for words, command in cli_commands():
        for param in cli_params(command):
            kind = param.type
            if isinstance(kind, click.types._NumberParamTypeBase):
                assert isinstance(kind, click.IntRange | click.FloatRange), (words, param.name)
                assert kind.min is not None and kind.max is not None, (words, param.name)


BAD_REQUESTS = {
    "--n past its bound": lambda out: RunRequest(experiment="matched", out=out, n=10**12),
    "--temperature NaN": lambda out: RunRequest(
        experiment="matched", out=out, sampler=Sampler(temperature=math.nan)
    ),
    "--temperature 1e-300": lambda out: Sampler(temperature=1e-300),
    "--temperature past its bound": lambda out: Sampler(temperature=1e9),
    "--top-p 0": lambda out: Sampler(top_p=0.0),
    "--seed negative": lambda out: Sampler(seed=-1),
    "--block-size past its bound": lambda out: make_backend("vllm", block_size=2**40),
    "--timeout infinite": lambda out: make_backend("http", timeout=math.inf),
    "--traffic past its bound": lambda out: make_backend("http", traffic=10**6),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_request_built_in_python_is_held_to_the_same_bounds(case: str, tmp_path: Path) -> None:
    with pytest.raises(KvreplayError, match="must|use 0"):
        request = BAD_REQUESTS[case](tmp_path / "out")
        request.check()
