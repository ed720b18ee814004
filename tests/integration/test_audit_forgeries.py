"""Issue 24: forgeries that used to pass the audit, each built as an adversary would, with
kvreplay's own encoders (rows rechained, digests and CSVs recomputed), and each caught
with a sentence naming the row or file at fault."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from forgery import audit, manifest, problems, read_rows, rechain, write_manifest
from helpers import invoke
from safetensors import safe_open
from safetensors.torch import save_file

from kvreplay.core.canonical import sha256_json
from kvreplay.core.items import BUILTIN_ITEMS, items_digest
from kvreplay.model.identity import file_digests


def assert_caught(folder: Path, *needles: str, exit_code: int = 1) -> None:
    result = audit(folder, "--sample", 0)
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    found = [p for p in problems(result) if all(n in p for n in needles)]
    assert found, (needles, problems(result))


def test_a_reuse_entry_planted_in_a_row_is_named_not_reexecuted_into_itself(run: Path) -> None:
    """Class 1: a row's inputs could once hand the audit a recorded suffix to 'reuse'."""
    rows = read_rows(run)
    fabricated = {"suffix_token_ids": [1, 2, 3]}
    rows[0]["data"]["inputs"] = {"reuse": {"left": fabricated}}
    rechain(run, rows)
    assert_caught(run, f"row {rows[0]['key']}", "inputs.reuse")
    result = audit(run, "--sample", 4)
    assert result.exit_code == 1 and "re-executed: 4" in result.output


@pytest.fixture
def fixed_prefix_run(run: Path) -> Path:
    """The matched run plus fixed-prefix on its bf16 live prefixes (copied from its rows)."""
    contract = manifest(run)["contract"]
    source, model = contract["items"]["source"], contract["run"]["model"]
    result = invoke(
        "run", "fixed-prefix", "--model", model, "--items", source, "--plan", "short",
        "--dtypes", "bf16,fp32", "--save-snapshots", "--out", run,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return run


def test_a_copied_prefix_that_is_not_its_source_rows_is_named(fixed_prefix_run: Path) -> None:
    """Class 1: a later phase's inputs must be what the run derives from other rows."""
    rows = read_rows(fixed_prefix_run)
    target = next(r for r in rows if r["key"].startswith("fixed-prefix/t0/"))
    target["data"]["inputs"]["prefix_token_ids"][-1] += 1
    rechain(fixed_prefix_run, rows, derive_csv=False)
    assert_caught(fixed_prefix_run, f"row {target['key']}", "inputs.prefix_token_ids is not row")


def test_a_sampled_row_reexecutes_the_rows_its_inputs_come_from(fixed_prefix_run: Path) -> None:
    keys = [r["key"] for r in read_rows(fixed_prefix_run)]
    seed = next(
        s for s in range(200) if random.Random(s).sample(keys, 1) == ["fixed-prefix/t0/bf16"]
    )
    result = audit(fixed_prefix_run, "--sample", 1, "--seed", seed)
    assert result.exit_code == 0, result.output
    # the sampled row, its prefix row and the matched row that prefix was copied from
    assert "re-executed: 3" in result.output


@pytest.mark.parametrize("where", ["backend", "run"])
def test_audit_refuses_remote_code_unless_asked(run: Path, where: str) -> None:
    """Class 2: a contract that says trust_remote_code, in its backend's entry or (the
    older layout) beside the model, no longer makes audit run code."""
    data = manifest(run)
    entry = data["contract"]["run"]
    (entry["backend"] if where == "backend" else entry)["trust_remote_code"] = True
    data["contract_sha256"] = sha256_json(data["contract"])
    write_manifest(run, data)
    rechain(run, read_rows(run), data["contract_sha256"])
    result = audit(run, "--sample", 0)
    assert result.exit_code == 2
    assert "pass --trust-remote-code to audit only if you trust it" in result.output


def test_a_forged_contract_hash_stops_the_audit_before_any_model_is_read(
    run: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvreplay.audit.reexecute
    import kvreplay.model.reading

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the audit read the model of a forged contract")

    # a backend describes its model through models.describe_source (Backend.describe_model)
    monkeypatch.setattr(kvreplay.model.reading, "describe_source", refuse)
    monkeypatch.setattr(kvreplay.audit.reexecute, "make_engine", refuse)
    data = manifest(run)
    data["contract"]["run"]["model"] = "/elsewhere"
    write_manifest(run, data)
    assert_caught(run, "manifest.json: field contract_sha256 does not match")


def test_a_planted_csv_is_named(run: Path) -> None:
    """Class 3: a file the run did not write would be analysed as the run's."""
    shutil.copy(run / "matched_live_prefill.csv", run / "fixed_prefix_2x2.csv")
    assert_caught(run, "fixed_prefix_2x2.csv: not a file this run wrote")


def test_edited_claims_report_and_header_are_named(run: Path) -> None:
    """Class 3: claims, report and figures are re-derived; header fields checked."""
    assert invoke("analyze", run).exit_code == 0
    assert invoke("report", run).exit_code == 0
    assert audit(run, "--sample", 0).exit_code == 0
    claims = json.loads((run / "claims.json").read_text())
    claims["matched_live_prefill"] = {"forged": True}
    (run / "claims.json").write_text(json.dumps(claims, indent=2, sort_keys=True) + "\n")
    report = run / "report.md"
    report.write_bytes(report.read_bytes().replace(b"\n", b"\r\n"))  # line endings too
    data = manifest(run)
    data["kvreplay_version"] = "<script>"
    data["signed_by"] = "someone"
    write_manifest(run, data)
    assert_caught(run, "claims.json: differs from its re-derivation")
    assert_caught(run, "report.md: differs from its re-derivation")
    assert_caught(run, "manifest.json: field kvreplay_version is malformed")
    assert_caught(run, "manifest.json: field signed_by is not one a kvreplay run writes")


def test_a_zeroed_snapshot_with_its_hashes_recomputed_is_named(run: Path) -> None:
    """Class 4: the tensors are fingerprinted, not the metadata believed."""
    rows = read_rows(run)
    arm = next(a for a in rows[0]["data"]["arms"].values() if isinstance(a.get("snapshot"), dict))
    path = run / arm["snapshot"]["file"]
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    zeroed = {k: torch.zeros_like(v) if k != "token_ids" else v for k, v in tensors.items()}
    save_file(zeroed, str(path), metadata=metadata)
    arm["snapshot"]["sha256"] = file_digests(path.parent, [path])[path.name]
    rechain(run, rows)
    assert_caught(run, f"row {rows[0]['key']}", "its tensors' cache_fingerprint differs")


def test_resuming_with_snapshots_on_a_fingerprints_only_header_is_named(run: Path) -> None:
    data = manifest(run)
    data["snapshots"] = "fingerprints only"
    write_manifest(run, data)
    assert_caught(run, "field snapshots says fingerprints only")


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("builtin") / "run"
    result = invoke(
        "run", "matched", "--model", tiny_dirs["qwen2"], "--items", "arith", "--n", "3",
        "--plan", "short", "--dtypes", "bf16", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_a_replaced_builtin_item_is_named(builtin_run: Path, tmp_path: Path) -> None:
    """Class 5: the items of a built-in set come from the package, not items.jsonl."""
    folder = tmp_path / "folder"
    shutil.copytree(builtin_run, folder)
    items = [json.loads(line) for line in (folder / "items.jsonl").read_text().splitlines()]
    items[0]["prompt"], items[0]["answer"] = "What is 1+1?", "2"
    (folder / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    from kvreplay.core.items import load_jsonl

    data = manifest(folder)
    data["contract"]["items"]["digest"] = items_digest(load_jsonl(folder / "items.jsonl"))
    data["contract_sha256"] = sha256_json(data["contract"])
    write_manifest(folder, data)
    rechain(folder, read_rows(folder), data["contract_sha256"])
    assert_caught(folder, "items.jsonl: is not the built-in item set 'arith'")
    assert items_digest(BUILTIN_ITEMS["arith"]()) != data["contract"]["items"]["digest"]


def test_cherry_picked_rows_are_named(builtin_run: Path, tmp_path: Path) -> None:
    """Class 5: drop an item's row, shrink item_ids, recompute every digest: the planned
    selection (the first n of the built-in set) still names the hole."""
    folder = tmp_path / "folder"
    shutil.copytree(builtin_run, folder)
    rows = [r for r in read_rows(folder) if r["data"]["item_id"] != "r0001"]
    data = manifest(folder)
    entry = data["experiments"]["matched"]
    entry["config"]["item_ids"] = [i for i in entry["config"]["item_ids"] if i != "r0001"]
    entry["config_sha256"] = sha256_json(entry["config"])
    write_manifest(folder, data)
    rechain(folder, rows)
    assert_caught(folder, "config.item_ids is not the first items of items.jsonl")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("arms",), []),
        (("arms", "left"), "x"),
        (("arms", "left", "suffix_token_ids"), "abc"),
        (("arms", "left", "suffix"), None),
        (("replicas",), 5),
        (("prefix_token_ids",), {"a": 1}),
        (("inputs",), []),
        (("status",), 3),
    ],
)
def test_a_hand_edited_field_of_the_wrong_type_is_named_not_raised(
    run: Path,
    path: tuple[str, ...],
    value: object,
) -> None:
    rows = read_rows(run)
    target = rows[0]["data"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    rechain(run, rows, derive_csv=False)
    result = audit(run, "--sample", 1)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit | None), result.exception  # no traceback
    item, precision = rows[0]["data"].get("item_id"), "bf16"
    named = (f"row {rows[0]['key']}", f"row {item} ({precision})")
    assert any(any(n in p for n in named) for p in problems(result)), result.output
