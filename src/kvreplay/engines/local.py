"""The local engine: one worker in this process, units in order (each noted for a
supervisor first, :mod:`kvreplay.engines.watch`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvreplay.contract.config import RunConfig
from kvreplay.engines.watch import note
from kvreplay.engines.worker import Worker
from kvreplay.harness.units import Unit


class LocalEngine:
    name = "local"

    def __init__(self, config: RunConfig):
        self.config = config
        self.worker = Worker(config, name="local")

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "worker_count": 1, "workers": [self.worker.device_info()]}

    def run(self, units: list[Unit]) -> Iterator[tuple[Unit, dict, dict, str]]:
        for unit in units:
            note(self.config.backend.name, self.config.run_dir, str(unit.key))
            data, timing = self.worker.run(unit)
            yield unit, data, timing, self.worker.name

    def close(self) -> None:
        """Nothing to release: models are freed with the process."""
