"""Issue 34, item 9: everything an audit can check from the run folder alone runs on every
row, and sampling limits only re-execution. Each forgery below sits in a row that
``--sample 1`` does not re-execute, is built as an adversary would (snapshot digests,
hash chain and CSV recomputed with kvreplay's own encoders), and must still fail the
audit with a sentence naming its row and field. A CSV rewritten with CRLF line endings
fails; a byte-identical copy of a run under another folder name passes."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from forgery import CSV, audit, problems, read_rows, rechain
from helpers import invoke
from safetensors import safe_open
from safetensors.torch import save_file

from kvreplay.model.identity import file_digests

Row = dict[str, Any]
Tensors = dict[str, torch.Tensor]
Metadata = dict[str, str]


def _unsampled(run: Path, target: str) -> int:
    """A seed whose sample of one row is not ``target``."""
    keys = [r["key"] for r in read_rows(run)]
    return next(s for s in range(100) if random.Random(s).sample(keys, 1) != [target])


def assert_caught_unsampled(run: Path, target: str, *needles: str) -> None:
    result = audit(run, "--sample", 1, "--seed", _unsampled(run, target))
    assert result.exit_code == 1, result.output
    assert "re-executed: 1" in result.stdout and "Traceback" not in result.output
    found = [p for p in problems(result) if all(n in p for n in (f"row {target}", *needles))]
    assert found, (needles, problems(result))


# Snapshots: a forger rewrites the file and recomputes its sha256 in the row.
def _edit_snapshot(run: Path, edit: Callable[[Tensors, Metadata], None]) -> str:
    rows = read_rows(run)
    target = rows[-1]
    arm = target["data"]["arms"]["prefill"]
    path = run / arm["snapshot"]["file"]
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    edit(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)
    arm["snapshot"]["sha256"] = file_digests(path.parent, [path])[path.name]
    rechain(run, rows)
    return target["key"]


def _zero_token_ids(tensors: Tensors, metadata: Metadata) -> None:
    tensors["token_ids"] = torch.zeros_like(tensors["token_ids"])


def _extra_tensor(tensors: Tensors, metadata: Metadata) -> None:
    tensors["layers.9.keys"] = torch.zeros(1)


def _metadata(**fields: str) -> Callable[[Tensors, Metadata], None]:
    return lambda tensors, metadata: metadata.update(fields)


SNAPSHOTS: dict[str, tuple[Callable[[Tensors, Metadata], None], str]] = {
    "token_ids_zeroed": (_zero_token_ids, "its token_ids tensor is not the row's prefix_token_ids"),
    "extra_tensor": (_extra_tensor, "holds other tensors than a snapshot of this model (layers.9"),
    "construction": (_metadata(construction="live"), "field construction of its metadata"),
    "layer_kinds": (_metadata(layer_kinds='["DynamicLayer:0"]'), "field layer_kinds of its"),
    "layer_lengths": (_metadata(layer_lengths="[5, 5, 5]"), "field layer_lengths of its"),
    "row_it_was_saved_for": (
        _metadata(extra='{"arm": "prefill", "row": "matched/t0/bf16"}'),
        "field extra of its",
    ),
    "metadata_added": (_metadata(signed_by="someone"), "holds other metadata than a snapshot"),
}


@pytest.mark.parametrize("case", list(SNAPSHOTS))
def test_a_snapshot_that_contradicts_its_row(case: str, run: Path) -> None:
    edit, expected = SNAPSHOTS[case]
    assert_caught_unsampled(run, _edit_snapshot(run, edit), "snapshot", expected)


# Rows: a field edited and everything else left as it was, the chain and CSV recomputed.
def _flip(*path: str) -> Callable[[Row], Any]:
    def edit(data: Row) -> Any:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = not data[path[-1]]

    return edit


def _set(value: Any, *path: str) -> Callable[[Row], Any]:
    def edit(data: Row) -> Any:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return edit


def _suffix_token(data: Row) -> None:
    data["arms"]["prefill"]["suffix_token_ids"][0] += 1


ROWS: dict[str, tuple[Callable[[Row], Any], str]] = {
    "correct_flipped": (_flip("arms", "prefill", "correct"),
                        "field arms.prefill.correct is not what its suffix scores against"),
    "answer_parsed_flipped": (_flip("arms", "left", "answer_parsed"),
                              "field arms.left.answer_parsed is not what its suffix scores"),
    "answer_edited": (_set("5", "arms", "prefill", "answer"), "field arms.prefill.answer"),
    "label_flipped": (_flip("labels", "suffix_equal"),
                      "field labels.suffix_equal is not what the row's arms derive"),
    "divergence_index": (_set(3, "labels", "first_suffix_divergence_index"),
                         "field labels.first_suffix_divergence_index"),
    "suffix_tokens": (_suffix_token, "field arms.prefill.suffix_token_ids is not what its"),
    "suffix_hash": (_set("0" * 64, "arms", "left", "suffix_sha256"),
                    "field arms.left.suffix_sha256"),
    "replica_gate": (_flip("replicas", "prefill", "suffix_exact"),
                     "field replicas.prefill.suffix_exact is not what the row's arms derive"),
    "comparison_exact": (_flip("comparison", "logits", "exact"),
                         "field comparison.logits.exact is not what the compared arms'"),
    "prefix_hash": (_set("0" * 64, "prefix_sha256"),
                    "field prefix_sha256 is not the hash of prefix_token_ids"),
    "prefix_count": (_set(3, "prefix_token_count"), "field prefix_token_count"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ROWS))
def test_a_row_that_contradicts_itself(case: str, run: Path) -> None:
    edit, expected = ROWS[case]
    rows = read_rows(run)
    edit(rows[-1]["data"])
    rechain(run, rows)
    assert_caught_unsampled(run, rows[-1]["key"], expected)


def test_sample_zero_checks_every_row_and_reexecutes_none(run: Path) -> None:
    rows = read_rows(run)
    rows[0]["data"]["arms"]["left"]["correct"] ^= True
    rechain(run, rows)
    result = audit(run, "--sample", 0)
    assert result.exit_code == 1 and "re-executed: 0" in result.stdout
    assert any(f"row {rows[0]['key']}: field arms.left.correct" in p for p in problems(result))


def test_a_csv_rewritten_with_crlf_line_endings_fails(run: Path) -> None:
    path = run / CSV
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    result = audit(run, "--sample", 0)
    assert result.exit_code == 1, result.output
    assert f"{CSV}: differs byte for byte from the CSV derived from rows.jsonl" in result.stdout
    assert invoke("analyze", run).exit_code == 2


def test_a_copy_under_another_folder_name_passes(run: Path, tmp_path: Path) -> None:
    """Derived files name no folder: a run audits wherever it is moved."""
    assert invoke("analyze", run).exit_code == 0
    assert invoke("report", run).exit_code == 0
    copy = tmp_path / "elsewhere" / "a-new-name"
    shutil.copytree(run, copy)
    result = audit(copy, "--sample", 0)
    assert result.exit_code == 0, result.output
    title = (copy / "report.md").read_text(encoding="utf-8").splitlines()[0]
    assert title.startswith("# kvreplay report: matched on ") and run.name not in title
    assert json.loads((copy / "manifest.json").read_text()) == json.loads(
        (run / "manifest.json").read_text()
    )
