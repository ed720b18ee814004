"""The worker every engine runs units on: it loads each precision's model once and hands
each unit to its experiment. A worker lives in the driver (local engine), in a spawned
process or in a Ray actor; it receives plain-data units and returns plain-data rows, so
every engine runs the same code."""

from __future__ import annotations

import gc
from typing import Any

from kvreplay.config import RunConfig
from kvreplay.errors import KvreplayError
from kvreplay.experiments import get_experiment
from kvreplay.experiments.units import Clock, Unit
from kvreplay.models import LoadedModel


class Worker:
    """Loads each precision's model once and runs units.

    ``device_map="auto"`` (set by the Ray engine for a worker with several GPUs) spreads
    a model too large for one GPU over all of them.
    """

    def __init__(self, config: RunConfig, name: str = "local", device_map: str | None = None):
        self.config = config
        self.name = name
        self.device_map = device_map
        self._models: dict[str, LoadedModel] = {}
        self._served: dict[str, Any] = {}

    def model(self, dtype: str) -> LoadedModel:
        if dtype not in self._models:
            lm = self.config.backend.load_model(self.config, dtype, self.device_map)
            if not lm.identity.matches(self.config.model_digest):
                raise KvreplayError(
                    f"Worker {self.name} loaded model files whose digest differs from the run's."
                )
            self._models[dtype] = lm
        return self._models[dtype]

    def served(self, dtype: str) -> Any:
        """A served backend's model for a precision (``Backend.open_served``). One at a
        time: a second engine would not fit beside the first on a GPU, and rows come
        precision by precision, so each starts once in a run."""
        if dtype not in self._served:
            self._served.clear()
            gc.collect()
            self._served[dtype] = self.config.backend.open_served(self.config, dtype)
        return self._served[dtype]

    def device_info(self) -> dict[str, str]:
        from kvreplay.environment import device_name

        return {
            "worker": self.name,
            "device": self.config.device,
            "device_name": device_name(self.config.device),
        }

    def run(self, unit: Unit) -> tuple[dict[str, Any], dict[str, float]]:
        # loading is neither model nor harness time of a row
        backend = self.config.backend
        (self.model if backend.kv_access else self.served)(unit.precision)
        clock = Clock()
        data = get_experiment(unit.experiment, backend).run_unit(self, unit, clock)
        return data, clock.timing()
