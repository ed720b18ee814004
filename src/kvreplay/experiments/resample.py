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
by :mod:`kvreplay.analysis.certificate`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvreplay.analysis.certificate import tv_distance
from kvreplay.canonical import canonical
from kvreplay.decode import Sampler
from kvreplay.errors import KvreplayError
from kvreplay.experiments.columns import Column, Line, kv
from kvreplay.experiments.experiment import Experiment, planned_keys
from kvreplay.experiments.panel import Arm, Panel, Samples, run_panel
from kvreplay.experiments.rows import ArmResult, PairLabels, PanelRow
from kvreplay.experiments.scope import Scope, Selection, own_options
from kvreplay.experiments.served import ServedArm, ServedPanel, run_served_panel
from kvreplay.experiments.units import Clock, Unit, UnitKey, Workbench
from kvreplay.items import Item
from kvreplay.ledger import Record

RESAMPLE = "resample"
# The most seeded samples per arm and row: the manifest lists every seed, and each is a
# decode of the whole suffix.
MAX_SAMPLES = 10_000


@dataclass(frozen=True)
class ResampleOptions:
    """The own options of ``resample``, typed and checked before anything is written."""

    samples: int = 16
    replica_samples: int = 2
    margin: float = 0.05

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
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise KvreplayError(
                f"--samples is {self.samples}; resample needs from 1 to {MAX_SAMPLES}."
            )
        if self.replica_samples < 1:
            raise KvreplayError(f"--replica-samples is {self.replica_samples}; it must be >= 1.")
        if not 0 < self.margin < 1:
            raise KvreplayError(f"--margin is {self.margin}; it must lie strictly between 0 and 1.")
        replace(sampler, seed=sampler.seed + self.samples - 1)  # the last seed must be valid

    def seeds(self, sampler: Sampler) -> list[int]:
        return [sampler.seed + k for k in range(self.samples)]


def _answers(samples: list[ArmResult]) -> list[str | None]:
    """Each seed's extracted answer; None where no answer parsed."""
    return [s.answer if s.answer_parsed else None for s in samples]


def distribution(answers: list[str | None]) -> list[list[Any]]:
    """Answer counts as sorted ``[answer, count]`` pairs (unparsed first, as null)."""
    counts = Counter(answers)
    return [[a, counts[a]] for a in sorted(counts, key=lambda a: (a is not None, a or ""))]


def _json(value: Any) -> str:
    return canonical(value).decode()


def _side(arm: str) -> Callable[[Line], list[ArmResult]]:
    return lambda x: x.row.samples[arm]


def _divergences(line: Line) -> list[int | None]:
    return [PairLabels.of(a, b).first_suffix_divergence_index for a, b in line.row.pairs]


def _changed(line: Line) -> int:
    return sum(a.suffix_sha256 != b.suffix_sha256 for a, b in line.row.pairs)


def _sampling(field: str) -> Column[Line]:
    return Column(field, lambda x: x.row.fields["resample"][field])


def _arm_columns(arm: str) -> list[Column[Line]]:
    samples = _side(arm)
    return [
        Column(f"{arm}_accuracy", lambda x: sum(s.correct for s in samples(x)) / len(samples(x))),
        Column(f"{arm}_answers", lambda x: _json(_answers(samples(x)))),
        Column(f"{arm}_correct", lambda x: _json([s.correct for s in samples(x)])),
        Column(f"{arm}_answer_distribution", lambda x: _json(distribution(_answers(samples(x))))),
        Column(f"{arm}_replica_exact", lambda x: x.row.replicas[arm].passed),
    ]


def _logits_exact(line: Line) -> bool:
    """Boundary logits bit-equal; on a served row, the first seed's first-step top
    logprobs (raw logits, before any sampling)."""
    if line.row.comparison is not None:
        return line.row.comparison.logits["exact"]
    live, prefill = (line.row.samples[arm][0] for arm in ("live", "prefill"))
    return live.logits_fingerprint == prefill.logits_fingerprint


def _tv(line: Line) -> float:
    live, prefill = (_answers(line.row.samples[arm]) for arm in ("live", "prefill"))
    return round(tv_distance(live, prefill), 9)


TABLE: list[Column[Line]] = [
    Column("row_id", lambda x: x.row.item_id),
    Column("source_row_sha256", lambda x: x.source_row_sha256),
    Column("precision", lambda x: x.row.precision),
    Column("prefix_token_count", lambda x: x.row.prefix["prefix_token_count"]),
    Column("prefix_sha256", lambda x: x.row.prefix["prefix_sha256"]),
    _sampling("temperature"),
    _sampling("top_p"),
    _sampling("margin"),
    Column("samples", lambda x: len(x.row.pairs)),
    Column("seeds", lambda x: _json(x.row.fields["resample"]["seeds"])),
    _sampling("replica_samples"),
    Column("live_prefill_cache_exact", kv(lambda c: c.cache_exact)),
    Column("live_prefill_logits_exact", lambda x: _logits_exact(x)),
    Column("boundary_argmax_equal", kv(lambda c: c.boundary_argmax_equal)),
    Column("seeds_changed", _changed),
    Column("share_changed", lambda x: round(_changed(x) / len(x.row.pairs), 9)),
    Column("first_divergence_indices", lambda x: _json(_divergences(x))),
    Column("tv_distance", _tv),
    *_arm_columns("live"),
    *_arm_columns("prefill"),
    Column("functional_state_equal", lambda x: x.row.functional_state_equal),
    Column("all_storage_disjoint", lambda x: x.row.all_storage_disjoint),
    Column("integrity_pass", lambda x: x.row.integrity_pass),
    Column("prompt_token_count", lambda x: x.row.prefix["prompt_token_count"]),
]


class Resample(Experiment):
    name = RESAMPLE
    csv_file = "resample_live_prefill.csv"
    panel = Panel((Arm("live", "live"), Arm("prefill", "prefill")))
    table = TABLE

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

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
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
        result = run_panel(worker, unit, clock, replace(self.panel, samples=samples))
        return result.row, result.prefix

    def lines(self, rows: list[Record]) -> list[Line]:
        return [Line(self.read_row(r.data), r.row_sha256) for r in rows if r.data["status"] == "ok"]


class ServedResample(Resample):
    """``resample`` on a serving backend: a prefix-cache hit (``live``) and a miss
    (``prefill``) of the same P, each continued once per seed with the engine's own
    per-request seeded sampler (see :mod:`kvreplay.experiments.served`); the K/V
    columns stay empty and ``backend`` names the engine."""

    panel = ServedPanel((ServedArm("live", "hit"), ServedArm("prefill", "miss")))  # type: ignore[assignment]
    table = [*TABLE, Column("backend", lambda x: x.row.fields["backend"])]

    def run_row(
        self, worker: Workbench, unit: Unit, clock: Clock, samples: Samples
    ) -> tuple[PanelRow | None, dict[str, Any]]:
        return run_served_panel(worker, unit, clock, replace(self.panel, samples=samples))
