"""The experiment layer's plain pieces: unit keys, replica gates, and the per-experiment
``kvreplay run`` subcommands (each lists only the options that apply to it)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvreplay.cli import main
from kvreplay.harness.rows import ReplicaGate
from kvreplay.harness.units import UnitKey
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


def test_every_experiment_writes_the_table_analysis_reads() -> None:
    """An experiment is a plugin: it writes the table the torch-free registry names for it
    (so the audit and analyze derive the CSV it wrote) and an analysis section reads that
    table (so analyze and report include it); a table's key columns are required ones."""
    from kvreplay.analysis.sections.registry import sections
    from kvreplay.experiments import EXPERIMENTS, experiment_at
    from kvreplay.experiments.registry import TABLES, experiment_tables

    for name, declaration in EXPERIMENTS.items():
        experiment = experiment_at(declaration.experiment, name)
        assert experiment_tables()[name][0] is experiment.table
        assert experiment.table.experiment == name and experiment.name == name
        if declaration.served:
            served = experiment_at(declaration.served, name).table
            assert experiment_tables()[name][1] is served
    tables = TABLES.values()
    assert set(tables) == {table for section in sections() for table in section.tables}
    for table in tables:
        required = {c.name for c in table.columns if c.use == "required"}
        assert set(table.key) - {"row_id"} <= required, table.file


def test_a_row_recorded_with_the_retired_comparison_field_reads_as_it_is_written_now() -> None:
    """Rows before the field was dropped carry ``comparison.first_suffix_divergence_index``
    as null: they read, and the audit compares a re-execution with the row written now."""
    import json
    from pathlib import Path

    from kvreplay.core.comparison import RETIRED, Comparison
    from kvreplay.harness.rows import PanelRow, row_as_written
    from kvreplay.ledger import diff_fields

    rows = Path(__file__).parents[2] / "results" / "smollm2-n24" / "rows.jsonl"
    records = [json.loads(line) for line in rows.read_text().splitlines()]
    data = next(r["data"] for r in records if r["experiment"] == "matched")
    assert data["comparison"][RETIRED] is None
    row = PanelRow.from_dict(data, ("left", "prefill"))
    assert RETIRED not in row.to_dict()["comparison"]
    assert diff_fields(row_as_written(data), row.to_dict()) == []
    forged = {**data["comparison"], RETIRED: 3}  # a value it never had stays, to be refused
    assert row_as_written({**data, "comparison": forged})["comparison"][RETIRED] == 3
    with pytest.raises(TypeError):
        Comparison.from_dict(forged)


def test_the_sections_read_in_the_papers_order_then_the_rest() -> None:
    """Each paper section states its place (``paper_order``); the report and claims read
    them in the paper's order, then every other section in registry order."""
    from kvreplay.analysis.sections.registry import sections

    names = [s.name for s in sections()]
    paper = ["matrix", "bridge", "historical", "transplant", "served", "stock", "resample"]
    assert names[: len(paper) + 2] == [*paper, "localize", "flip"]
    assert "history" in names[len(paper) + 2 :]


def test_a_panel_takes_prefixes_from_the_declared_sources_in_their_rank() -> None:
    """Which rows record a prefix is each source's declaration (its rank, its prefix
    kind): a fixed-prefix prefix row before a matched row at the prefix precision, and
    none of a matrix row or another precision."""
    from kvreplay.experiments.registry import outcome_sources
    from kvreplay.harness.selection import prefix_rows

    def row(experiment: str, item: str, precision: str, kind: str | None = None) -> Record:
        data = {"item_id": item, "precision": precision, "status": "ok", "prefix_token_ids": []}
        key = f"{experiment}/{item}/{precision}/{kind}"
        return _record(key, experiment, data | ({"kind": kind} if kind else {}))

    rows = [
        row("matched", "a", "bf16"),
        row("fixed-prefix", "a", "bf16", "matrix"),
        row("fixed-prefix", "a", "bf16", "prefix"),
        row("matched", "b", "fp32"),
        row("matched", "b", "bf16"),
        row("fixed-prefix", "c", "bf16", "matrix"),
    ]
    sources = outcome_sources()
    assert [s.name for s in sources] == ["fixed-prefix", "matched"]
    found = prefix_rows({r.key: r for r in rows}, "bf16", sources)
    assert {item: r.key for item, r in found.items()} == {
        "a": "fixed-prefix/a/bf16/prefix",
        "b": "matched/b/bf16/None",
    }
