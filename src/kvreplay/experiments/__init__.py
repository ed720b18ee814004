"""The registry of experiments that ``kvreplay run`` knows."""

from __future__ import annotations

from kvreplay.errors import KvreplayError
from kvreplay.experiments.bridge import Bridge
from kvreplay.experiments.experiment import Experiment
from kvreplay.experiments.fixed_prefix import FixedPrefix
from kvreplay.experiments.localize import Localize
from kvreplay.experiments.matched import Matched
from kvreplay.experiments.resample import Resample
from kvreplay.experiments.transplant import Transplant

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e for e in (Matched(), FixedPrefix(), Bridge(), Transplant(), Resample(), Localize())
}


def get_experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise KvreplayError(f"Unknown experiment {name!r}; choose {', '.join(EXPERIMENTS)}.")
    return EXPERIMENTS[name]
