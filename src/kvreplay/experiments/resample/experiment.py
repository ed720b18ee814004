"""``resample``: is resampling from a rebuilt prefix distributionally faithful?
(``resample_live_prefill.csv``)

Per item and precision, the retained live state and a one-shot prefill of the same
prefix P are each continued once per seed (``--samples K`` seeds from ``--seed S0``:
S0, S0+1, ...) at the run's temperature and top-p. The same seed drives both arms, so
every seed is a paired comparison: a sample that differs was changed by the state, not
by the sampler. Each arm has a replica that continues only the first
``--replica-samples R`` seeds and must reproduce them token for token (the integrity
gate), so a row costs 2K + 2R continuations rather than 4K. The live prefix is itself
generated with the run's sampler (seed S0). The certificate over the CSV is computed
by :mod:`kvreplay.measure.certificate`; the CSV is declared in
:mod:`kvreplay.experiments.resample.table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.core.options import option
from kvreplay.core.sampler import Sampler
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Arm, Panel, Samples
from kvreplay.harness.rows import PanelRow
from kvreplay.harness.scope import Scope, Selection, own_options
from kvreplay.harness.served import EVERY_STAGE, MISS, ServedArm, miss_input, run_served_panel
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

# The most seeded samples per arm and row: the manifest lists every seed, and each is a
# decode of the whole suffix.
MAX_SAMPLES = 10_000


@dataclass(frozen=True)
class ResampleOptions:
    """The own options of ``resample``, typed and checked before anything is written."""

    samples: int = field(
        default=16,
        metadata=option(
            "--samples", "Seeded samples per arm and row.", minimum=1, maximum=MAX_SAMPLES
        ),
    )
    replica_samples: int = field(
        default=2,
        metadata=option(
            "--replica-samples",
            "Seeds each replica continues to gate determinism.",
            minimum=1,
            maximum=MAX_SAMPLES,
        ),
    )
    margin: float = field(
        default=0.05,
        metadata=option(
            "--margin", "Equivalence margin of the certificate, in (0, 1).", minimum=0, maximum=1
        ),
    )

    @classmethod
    def of(cls, scope: Scope) -> ResampleOptions:
        options = own_options(cls, scope, "resample's")
        options.check(scope.config.sampler)
        return options

    def check(self, sampler: Sampler) -> None:
        if sampler.greedy:
            raise KvreplayError(
                "resample samples at a temperature above 0, but --temperature is 0."
            )
        if not 0 < self.margin < 1:
            raise KvreplayError(f"--margin is {self.margin}; it must lie strictly between 0 and 1.")
        replace(sampler, seed=sampler.seed + self.samples - 1)  # the last seed must be valid

    def seeds(self, sampler: Sampler) -> list[int]:
        return [sampler.seed + k for k in range(self.samples)]


class Resample(Experiment):
    panel = Panel((Arm("live", "live"), Arm("prefill", "prefill")))

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        ResampleOptions.of(scope)
        return super().select(scope, rows)

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        options, sampler = ResampleOptions.of(scope), scope.config.sampler
        return {
            "dtypes": list(scope.dtypes),
            "item_ids": [item.id for item in selection.items],
            "samples": options.samples,
            "seeds": options.seeds(sampler),
            "replica_samples": min(options.replica_samples, options.samples),
            "temperature": sampler.temperature,
            "top_p": sampler.top_p,
            "margin": options.margin,
            "batching": "singleton",
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        config = self.config(scope, selection)
        inputs = {k: config[k] for k in ("seeds", "replica_samples", "margin")}
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype, {"resample": inputs})
            for dtype in scope.dtypes
            for item in selection.items
        ]

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        inputs = unit.inputs["resample"]
        samples = Samples(tuple(inputs["seeds"]), inputs["replica_samples"])
        row, prefix = self.run_row(worker, unit, clock, samples)
        if row is None:
            return {"item_id": unit.item.id, "precision": unit.precision, "status": "unreached",
                    **prefix}  # fmt: skip
        sampler = worker.config.sampler
        row.fields |= {
            "resample": {
                **inputs,
                "temperature": sampler.temperature,
                "top_p": sampler.top_p,
            }
        }
        return row.to_dict()

    def run_row(
        self, worker: Workbench, unit: Unit, clock: Clock, samples: Samples
    ) -> tuple[PanelRow | None, dict[str, Any]]:
        from kvreplay.harness.executor import run_panel  # in process only: loads torch

        result = run_panel(worker, unit, clock, replace(self.panel, samples=samples))
        return result.row, result.prefix


class ServedResample(Resample):
    """``resample`` on a serving backend: a prefix-cache hit (``live``) and a miss
    (``prefill``) of the same P, each continued once per seed with the engine's own
    per-request seeded sampler (see :mod:`kvreplay.harness.served`); the K/V
    columns stay empty and ``backend`` names the engine."""

    served = True

    panel = Panel((ServedArm("live", "hit"), ServedArm("prefill", "miss")))

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        return {**super().config(scope, selection), MISS: EVERY_STAGE}

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        """Each unit also says how its miss arm serves later stages."""
        miss = miss_input(self.config(scope, selection))
        return [
            replace(unit, inputs={**unit.inputs, **miss})
            for unit in super().units(phase, scope, selection, rows)
        ]

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        return {
            str(UnitKey(self.name, item_id, dtype)): miss_input(config)
            for dtype in config["dtypes"]
            for item_id in config["item_ids"]
        }

    def run_row(
        self, worker: Workbench, unit: Unit, clock: Clock, samples: Samples
    ) -> tuple[PanelRow | None, dict[str, Any]]:
        return run_served_panel(worker, unit, clock, replace(self.panel, samples=samples))
