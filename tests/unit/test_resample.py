"""Resampled panels on a tiny model (issue 14): the one executor continues every arm once
per seed, replicas gate the first seeds, and a state resampled against a bit-exact
rebuild of itself is certified faithful.

The faithful case runs the panel with the prefill arm replaced by ``replay``, the
teacher-forced rebuild that is bit-exact with live by construction (docs/design.md), so
the two arms are the same state and every seed must give both the same sample, on any CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from helpers import PROMPTS, SHORT

from kvreplay import LoadedModel
from kvreplay.contract.config import RunConfig
from kvreplay.core.items import Item
from kvreplay.core.sampler import Sampler
from kvreplay.harness.executor import run_panel
from kvreplay.harness.panel import Arm, Panel, Samples
from kvreplay.harness.rows import PanelRow
from kvreplay.harness.units import Clock, Unit, UnitKey
from kvreplay.measure.certificate import FAITHFUL, UNDECIDED, PairedSamples, certify


@dataclass
class Bench:
    """A worker with one tiny model and a sampling configuration."""

    config: RunConfig
    lm: LoadedModel

    def model(self, dtype: str) -> LoadedModel:
        return self.lm


def resampled(lm: LoadedModel, panel: Panel, seed: int = 0) -> PanelRow:
    config = RunConfig(model="tiny", model_digest="-", plan=SHORT, sampler=Sampler(0.7, 1.0, seed))
    unit = Unit(UnitKey("resample", "t", "fp32"), Item("t", PROMPTS[0], "5"), "fp32")
    row = run_panel(Bench(config, lm), unit, Clock(), panel).row
    assert row is not None
    return row


def as_paired(row: PanelRow, k: int | None = None) -> PairedSamples:
    """The first ``k`` seeds; each seed's whole suffix is its outcome (the strictest
    notion of the same sample)."""
    pairs = row.pairs[:k]
    return PairedSamples(
        item=row.item_id,
        live=tuple(a.suffix_sha256 for a, _ in pairs),
        prefill=tuple(b.suffix_sha256 for _, b in pairs),
        live_correct=tuple(a.correct for a, _ in pairs),
        prefill_correct=tuple(b.correct for _, b in pairs),
        changed=tuple(a.suffix_sha256 != b.suffix_sha256 for a, b in pairs),
    )


def test_every_arm_runs_once_per_seed_and_replicas_the_first(
    tiny_lm: Callable[[str, str], LoadedModel],
) -> None:
    panel = Panel((Arm("live", "live"), Arm("prefill", "prefill")), samples=Samples((3, 4, 5), 2))
    row = resampled(tiny_lm("qwen2", "fp32"), panel, seed=3)
    assert row.arms == {}
    assert {name: len(s) for name, s in row.samples.items()} == {
        "live": 3, "live_replica": 2, "prefill": 3, "prefill_replica": 2
    }  # fmt: skip
    assert row.integrity_pass and all(gate.suffix_exact for gate in row.replicas.values())
    assert len(row.pairs) == 3
    # different seeds, different samples; a row read back is the row written
    assert len({s.suffix_sha256 for s in row.samples["live"]}) == 3
    assert PanelRow.from_dict(row.to_dict(), row.compared).to_dict() == row.to_dict()


def test_a_state_against_its_bit_exact_rebuild_is_certified_faithful(
    tiny_lm: Callable[[str, str], LoadedModel],
) -> None:
    seeds = tuple(range(40))
    panel = Panel((Arm("live", "live"), Arm("replay", "replay")), samples=Samples(seeds, 1))
    row = resampled(tiny_lm("qwen2", "bf16"), panel)
    item = as_paired(row)
    assert not any(item.changed)
    certificate = certify([item], margin=0.1)
    assert certificate.verdict == FAITHFUL, certificate.sentence()
    # four seeds of the same state are not yet enough evidence
    assert certify([as_paired(row, 4)], margin=0.1).verdict == UNDECIDED
