"""The experiment layer's plain pieces: unit keys, replica gates, and the per-experiment
``kvreplay run`` subcommands (each lists only the options that apply to it)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvreplay.cli import main
from kvreplay.experiments.rows import ReplicaGate
from kvreplay.experiments.units import UnitKey
from kvreplay.ledger import Record


def _record(key: str, experiment: str, data: dict) -> Record:
    return Record(0, key, experiment, data, "local", {}, "", "", "")


@pytest.mark.parametrize(
    ("key", "text", "data"),
    [
        (UnitKey("matched", "r1", "bf16"), "matched/r1/bf16", {"precision": "bf16"}),
        (UnitKey.prefix("fixed-prefix", "r1"), "fixed-prefix/prefix/r1", {"kind": "prefix"}),
    ],
)
def test_a_unit_key_prints_as_the_ledger_key_and_is_read_back_from_its_row(
    key: UnitKey, text: str, data: dict
) -> None:
    assert str(key) == text
    record = _record(text, key.experiment, {"item_id": "r1", "precision": "bf16", **data})
    assert UnitKey.of(record) == key
    assert key.is_prefix == (key.precision is None)


def test_a_replica_gate_passes_only_when_every_check_it_holds_passes() -> None:
    clone = ReplicaGate(cache_exact=True, logits_exact=True)
    assert (
        clone.is_clone
        and clone.passed
        and clone.to_dict()
        == {
            "cache_exact": True,
            "logits_exact": True,
        }
    )
    replica = ReplicaGate(True, True, storage_disjoint=True, suffix_exact=False)
    assert not replica.is_clone and not replica.passed
    assert ReplicaGate.from_dict(replica.to_dict()) == replica


OWN_OPTIONS = {
    "matched": set(),
    "fixed-prefix": {"--prefix-from"},
    "bridge": {"--prefix-from"},
    "transplant": {"--prefix-from", "--panel", "--alias", "--name", "--divergent",
                   "--controls", "--panel-seed"},
    "localize": {"--prefix-from", "--divergent", "--panel-seed", "--both-directions"},
}  # fmt: skip
EXPERIMENT_ONLY = set().union(*OWN_OPTIONS.values())


@pytest.mark.parametrize("experiment", list(OWN_OPTIONS))
def test_run_help_lists_only_the_options_that_apply(experiment: str) -> None:
    result = CliRunner().invoke(main, ["run", experiment, "--help"])
    assert result.exit_code == 0, result.output
    listed = {word.rstrip(",") for word in result.output.split() if word.startswith("--")}
    assert listed & EXPERIMENT_ONLY == OWN_OPTIONS[experiment]
    assert {"--out", "--model", "--dtypes", "--threads", "--engine"} <= listed


def test_an_option_of_another_experiment_is_refused_in_one_sentence() -> None:
    result = CliRunner().invoke(main, ["run", "matched", "--panel", "blind", "--out", "x"])
    assert result.exit_code == 2
    assert result.stderr.startswith("kvreplay: error: No such option '--panel'")


def test_analyze_reads_only_columns_that_each_experiment_declares() -> None:
    """The analysis reader's required and optional columns are part of the CSV each
    experiment declares, so a run's own CSVs always pass through ``kvreplay analyze``."""
    from kvreplay.analysis.ledgers import spec_for
    from kvreplay.experiments import EXPERIMENTS

    checked = 0
    for experiment in EXPERIMENTS.values():
        spec = spec_for(experiment.csv_file)
        if spec is None:
            continue
        assert {*spec.key, *spec.columns, *spec.optional} <= set(experiment.columns)
        checked += 1
    assert checked == 5  # matched, fixed-prefix, bridge, transplant, resample
