"""The worker every engine runs units on: it loads each precision's model once and hands
each unit to its experiment. A worker lives in the driver (local engine), in a spawned
process or in a Ray actor; it receives plain-data units and returns plain-data rows, so
every engine runs the same code."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from kvreplay.contract.config import RunConfig
from kvreplay.core.errors import KvreplayError
from kvreplay.experiments import get_experiment
from kvreplay.harness.units import Clock, Unit

if TYPE_CHECKING:
    from kvreplay.backends.hf.loading import LoadedModel


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
            if self.config.backend.capabilities.cache_control:
                self._release()  # an engine holds its device's memory: one at a time
            lm = self.config.backend.load_model(self.config.model_ref, dtype, self.device_map)
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
            self._release()
            self._served[dtype] = self.config.backend.open_served(self.config.model_ref, dtype)
        return self._served[dtype]

    def _release(self) -> None:
        """Drop every engine this worker holds, so that the next one has the device."""
        self._models.clear()
        self._served.clear()
        gc.collect()

    def device_info(self) -> dict[str, str]:
        from kvreplay.contract.environment import device_name

        return {
            "worker": self.name,
            "device": self.config.device,
            "device_name": device_name(self.config.device),
        }

    def run(self, unit: Unit) -> tuple[dict[str, Any], dict[str, float]]:
        # loading is neither model nor harness time of a row
        experiment = get_experiment(unit.experiment, self.config.backend)
        (self.served if experiment.served else self.model)(unit.precision)
        clock = Clock()
        data = experiment.run_unit(self, unit, clock)
        return data, clock.timing()
