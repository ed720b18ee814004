"""The audit's check of each experiment's entry in the manifest against what a run
writes there: a config that hashes to its ``config_sha256`` can still hold a key no run
writes (a ``"verdict": "pass"``, say) or a value of the wrong type, which a reader of
the manifest would take as the run's. Each such key or type is named."""

from __future__ import annotations

from typing import Any

from kvreplay.experiments.registry import declared, recorded_table
from kvreplay.harness.table import SCHEMA_VERSION
from kvreplay.ledger import EXPERIMENT_ENTRY


def _typed(value: Any, kinds: type | tuple[type, ...]) -> bool:
    """JSON typing: a flag is not a number (``bool`` is an ``int`` to Python)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _kinds(kinds: type | tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer",
             float: "a number", bool: "a flag", type(None): "null"}  # fmt: skip
    listed = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names[kind] for kind in listed))


def experiment_block_problems(manifest: dict[str, Any]) -> list[str]:
    """Each experiment's entry: only the fields a run writes, each of its type, and a
    config holding only its experiment's declared keys (and the table's schema version),
    each of its declared type, and a schema version its CSV's table has. An experiment
    this kvreplay does not know is named elsewhere (its CSV cannot be derived)."""
    problems = []
    experiments = declared()
    for name, entry in manifest["experiments"].items():
        where = f"manifest.json: field experiments.{name}"
        for key, value in entry.items():
            if key not in EXPERIMENT_ENTRY:
                problems.append(f"{where}.{key} is not one a kvreplay run writes")
            elif not _typed(value, EXPERIMENT_ENTRY[key]):
                problems.append(f"{where}.{key} is not {_kinds(EXPERIMENT_ENTRY[key])}")
        schema = experiments[name].config if name in experiments else None
        if schema is None:
            continue
        schema = {**schema, SCHEMA_VERSION: int}
        for key, value in entry["config"].items():
            if key not in schema:
                problems.append(f"{where}.config.{key} is not one {name} records")
            elif not _typed(value, schema[key]):
                problems.append(f"{where}.config.{key} is not {_kinds(schema[key])}")
        version = entry["config"].get(SCHEMA_VERSION, 1)
        table = recorded_table(name, manifest)
        if table is not None and _typed(version, int) and not 1 <= version <= table.version:
            problems.append(
                f"{where}.config.{SCHEMA_VERSION} is {version}, not a version of its CSV's "
                f"schema (1 to {table.version})"
            )
    return problems
