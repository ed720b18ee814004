"""The audit's check of each experiment's entry in the manifest against what a run
writes there: a config that hashes to its ``config_sha256`` can still hold a key no run
writes (a ``"verdict": "pass"``, say), a value of the wrong type or one no run writes,
or fields that contradict each other, which a reader of the manifest would take as the
run's. Each is named, against the experiment's declared schema
(:mod:`kvreplay.harness.schema`)."""

from __future__ import annotations

from typing import Any

from kvreplay.experiments.registry import declared, recorded_table
from kvreplay.harness.schema import kinds_text, typed
from kvreplay.harness.table import SCHEMA_VERSION
from kvreplay.ledger import EXPERIMENT_ENTRY


def experiment_block_problems(manifest: dict[str, Any]) -> list[str]:
    """Each experiment's entry: only the fields a run writes, each of its type, and a
    config as its experiment's declared schema says (its fields, their types and values,
    and their relations), with a schema version its CSV's table has. An experiment this
    kvreplay does not know is named elsewhere (its CSV cannot be derived)."""
    problems = []
    experiments = declared()
    for name, entry in manifest["experiments"].items():
        where = f"manifest.json: field experiments.{name}"
        for key, value in entry.items():
            if key not in EXPERIMENT_ENTRY:
                problems.append(f"{where}.{key} is not one a kvreplay run writes")
            elif not typed(value, EXPERIMENT_ENTRY[key]):
                problems.append(f"{where}.{key} is not {kinds_text(EXPERIMENT_ENTRY[key])}")
        if name not in experiments:
            continue
        schema = experiments[name].schema
        assert schema is not None  # a declaration without one is refused
        problems += schema.config_problems(entry["config"], f"{where}.config", SCHEMA_VERSION)
        version = entry["config"].get(SCHEMA_VERSION, 1)
        table = recorded_table(name, manifest)
        if table is not None and typed(version, int) and not 1 <= version <= table.version:
            problems.append(
                f"{where}.config.{SCHEMA_VERSION} is {version}, not a version of its CSV's "
                f"schema (1 to {table.version})"
            )
    return problems
