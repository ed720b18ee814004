"""Audit gaps of issue 11: each forgery that used to pass is named by the row, field or
file at fault. A careful forger is assumed: rows are rechained, hashes recomputed and
the CSV re-derived, so only the checks against the plan, the contract and items.jsonl
can catch it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from forgery import audit, manifest, problems, read_rows, rechain, write_manifest

from kvreplay.core.canonical import sha256_json

CSV = "matched_live_prefill.csv"


def delete_last_row_and_its_csv_line(folder: Path) -> str:
    rows = read_rows(folder)
    rechain(folder, rows[:-1])
    return f"row {rows[-1]['key']}: missing from rows.jsonl"


def delete_middle_row_rechained(folder: Path) -> str:
    rows = read_rows(folder)
    rechain(folder, rows[:1] + rows[2:])
    return f"row {rows[1]['key']}: missing from rows.jsonl"


def delete_middle_row(folder: Path) -> str:
    lines = (folder / "rows.jsonl").read_text().splitlines(keepends=True)
    (folder / "rows.jsonl").write_text("".join(lines[:1] + lines[2:]))
    return f"row {json.loads(lines[1])['key']}: missing from rows.jsonl"


def _edit_config(folder: Path, key: str, value: object) -> None:
    data = manifest(folder)
    entry = data["experiments"]["matched"]
    entry["config"][key] = value
    entry["config_sha256"] = sha256_json(entry["config"])  # the forger recomputes it
    write_manifest(folder, data)


def config_item_ids_edited(folder: Path) -> str:
    _edit_config(folder, "item_ids", ["t0"])
    return "row matched/t1/bf16: not planned by experiments.matched.config"


def config_dtypes_edited(folder: Path) -> str:
    _edit_config(folder, "dtypes", ["bf16"])
    return "row matched/t0/fp32: not planned by experiments.matched.config"


def config_edited_without_its_hash(folder: Path) -> str:
    data = manifest(folder)
    data["experiments"]["matched"]["config"]["dtypes"] = ["fp32", "bf16"]
    write_manifest(folder, data)
    return "manifest.json: field experiments.matched.config_sha256 does not match"


def contract_sha256_zeroed(folder: Path) -> str:
    data = manifest(folder)
    data["contract_sha256"] = "0" * 64
    write_manifest(folder, data)
    return "manifest.json: field contract_sha256 does not match the contract"


def _edit_contract(folder: Path, section: str, key: str, value: object) -> None:
    data = manifest(folder)
    data["contract"][section][key] = value
    data["contract_sha256"] = sha256_json(data["contract"])
    write_manifest(folder, data)
    rechain(folder, read_rows(folder), data["contract_sha256"])


def contract_layers_edited_and_rechained(folder: Path) -> str:
    _edit_contract(folder, "model_info", "num_layers", 99)
    return "manifest.json: field contract.model_info.num_layers differs from what this machine"


def contract_dtype_flags_edited_and_rechained(folder: Path) -> str:
    flags = {**manifest(folder)["contract"]["environment"]["dtype_contract"]}
    _edit_contract(folder, "environment", "dtype_contract", flags | {"cudnn_allow_tf32": False})
    return "field contract.environment.dtype_contract.cudnn_allow_tf32 differs from what this"


def _edit_item(folder: Path, key: str, value: object) -> None:
    path = folder / "items.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines()]
    items[0][key] = value
    path.write_text("".join(json.dumps(i, sort_keys=True) + "\n" for i in items))


def item_answer_edited(folder: Path) -> str:
    _edit_item(folder, "answer", "6")
    return "items.jsonl: does not match the contract's record of the items"


def item_meta_edited(folder: Path) -> str:
    _edit_item(folder, "meta", {"source": "forged"})
    return "items.jsonl: does not match the contract's record of the items"


def item_prompt_edited(folder: Path) -> str:
    _edit_item(folder, "prompt", "What is 2+4?")
    return "items.jsonl: does not match the contract's record of the items"


def row_without_precision_rechained(folder: Path) -> str:
    rows = read_rows(folder)
    del rows[0]["data"]["precision"]
    rechain(folder, rows, derive_csv=False)  # the CSV cannot be derived any more
    return f"row {rows[0]['key']}: field precision is missing or malformed"


TAMPERS: dict[str, Callable[[Path], str]] = {
    f.__name__: f
    for f in (
        delete_last_row_and_its_csv_line, delete_middle_row_rechained, delete_middle_row,
        config_item_ids_edited, config_dtypes_edited, config_edited_without_its_hash,
        contract_sha256_zeroed, contract_layers_edited_and_rechained,
        contract_dtype_flags_edited_and_rechained, item_answer_edited, item_meta_edited,
        item_prompt_edited, row_without_precision_rechained,
    )
}  # fmt: skip


@pytest.mark.parametrize("kind", list(TAMPERS))
def test_audit_names_each_forgery(kind: str, run: Path) -> None:
    expected = TAMPERS[kind](run)
    # Every one is caught by a structural check: no re-execution needed.
    result = audit(run, "--sample", 0)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert any(expected in p for p in problems(result)), (expected, problems(result))


def test_another_library_version_is_refused_with_the_rebuild_command(run: Path) -> None:
    """A run made with other library versions cannot be vouched for here: the audit names
    the packages and the one command that rebuilds the run's environment, exit 2."""
    _edit_contract(run, "environment", "transformers", "0.0.1")
    result = audit(run, "--sample", 0)
    assert result.exit_code == 2, result.output
    assert "was made with transformers 0.0.1 (here " in result.output
    assert f"kvreplay env {run} --venv .venv-{run.name}" in result.output


def test_a_deleted_middle_row_is_named_itself(run: Path) -> None:
    """Not only the next row's broken link: the deleted row is named as missing."""
    expected = delete_middle_row(run)
    found = problems(audit(run, "--sample", 0))
    assert found[0].startswith(expected.split(":")[0]) or any(expected in p for p in found)
