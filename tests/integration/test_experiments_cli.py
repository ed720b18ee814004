"""End to end through the CLI on a tiny model: ``matched``, ``fixed-prefix`` and ``bridge``.

One shared run folder gets all three experiments in order (so fixed-prefix and the bridge
reuse matched's prefixes); fresh folders get fixed-prefix and the bridge alone, to show
that reuse never changes a result. Runs are built once per module with the ``short``
plan and one torch thread (the shared CI box is oversubscribed; one thread is ~10x faster
there, and the manifest records the thread count).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import transformers
from click.testing import Result
from helpers import invoke

from kvreplay.core.canonical import sha256_json
from kvreplay.core.items import items_digest, load_items
from kvreplay.ledger import parse_rows

PAPER_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "paper-release" / "data"

# The paper's published ledger headers (schema only; no data rows are copied).
PAPER_HEADERS: dict[str, list[str]] = {
    "matched_live_prefill.csv": [
        "row_id", "source_row_sha256", "precision", "prefix_token_count", "prefix_sha256",
        "live_replica_cache_exact", "live_replica_logits_exact", "live_replica_suffix_exact",
        "prefill_replica_cache_exact", "prefill_replica_logits_exact",
        "prefill_replica_suffix_exact", "functional_state_equal", "all_storage_disjoint",
        "live_prefill_cache_exact", "cache_max_abs_diff", "cache_mean_abs_diff",
        "live_prefill_logits_exact", "logit_max_abs_diff", "logit_mean_abs_diff",
        "boundary_argmax_equal", "live_suffix_sha256", "live_replica_suffix_sha256",
        "prefill_suffix_sha256", "prefill_replica_suffix_sha256", "suffix_equal",
        "first_suffix_divergence_index", "trace_equal", "merge_equal", "answer_equal",
        "live_correct", "prefill_correct", "integrity_pass",
    ],
    "fixed_prefix_2x2.csv": [
        "row_id", "source_row_sha256", "precision", "prefix_token_count", "prefix_sha256",
        "incremental_replica_cache_exact", "incremental_replica_logits_exact",
        "incremental_replica_suffix_exact", "prefill_replica_cache_exact",
        "prefill_replica_logits_exact", "prefill_replica_suffix_exact",
        "functional_state_equal", "all_storage_disjoint", "incremental_prefill_cache_exact",
        "cache_max_abs_diff", "cache_mean_abs_diff", "cache_delta_l2_norm",
        "cache_left_l2_norm", "cache_right_l2_norm", "cache_relative_l2_diff",
        "incremental_prefill_logits_exact", "logit_max_abs_diff", "logit_mean_abs_diff",
        "boundary_argmax_equal", "incremental_suffix_sha256",
        "incremental_replica_suffix_sha256", "prefill_suffix_sha256",
        "prefill_replica_suffix_sha256", "suffix_equal", "first_suffix_divergence_index",
        "trace_equal", "merge_equal", "answer_equal", "incremental_correct",
        "prefill_correct", "integrity_pass",
    ],
    "live_teacher_bridge.csv": [
        "row_id", "source_row_sha256", "selection_index", "new_prefix_token_count",
        "new_prefix_sha256", "historical_prefix_token_count", "historical_prefix_sha256",
        "live_matches_historical_prefix", "boundary_cache_sequence_len",
        "post_decode_cache_sequence_len", "live_clone_cache_exact", "live_clone_logits_exact",
        "teacher_clone_cache_exact", "teacher_clone_logits_exact", "functional_state_equal",
        "all_storage_disjoint", "live_teacher_cache_exact", "live_teacher_logits_exact",
        "boundary_argmax_equal", "live_suffix_sha256", "teacher_suffix_sha256",
        "live_teacher_suffix_exact", "all_48_layers_exact", "integrity_pass",
    ],
}  # fmt: skip
CSV_OF = {
    "matched": "matched_live_prefill.csv",
    "fixed-prefix": "fixed_prefix_2x2.csv",
    "bridge": "live_teacher_bridge.csv",
}
PROMPTS = [
    ("a1", "What is 2+3?", "5"),
    ("a2", "Tom has 3 apples and gets 4 more. How many?", "7"),
    ("a3", "Compute 4*5.", "20"),
]
N = 2  # items per experiment
ARCH = "qwen2"
# Fields that name where a row's inputs came from, not what it computed.
PROVENANCE = {"reused_from", "source", "inputs", "historical"}


def run_ok(experiment: str, out: Path, model: Path, items: Path, *extra: str) -> Result:
    result = invoke(
        "run", experiment, "--model", model, "--items", items, "--plan", "short",
        "--out", out, *extra,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture(scope="module")
def model(tiny_dirs: dict[str, Path]) -> Path:
    return tiny_dirs[ARCH]


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("items") / "items.jsonl"
    lines = [json.dumps({"id": i, "prompt": p, "answer": a}) for i, p, a in PROMPTS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, model: Path, items: Path) -> Path:
    """matched, then fixed-prefix, then the bridge, all in one run folder."""
    out = tmp_path_factory.mktemp("shared") / "run"
    run_ok("matched", out, model, items, "--n", N, "--dtypes", "bf16,fp32")
    run_ok("fixed-prefix", out, model, items, "--n", N, "--dtypes", "bf16,fp32")
    run_ok("bridge", out, model, items, "--n", N, "--dtypes", "bf16,fp32")
    return out


@pytest.fixture(scope="module")
def fresh_fixed(tmp_path_factory: pytest.TempPathFactory, model: Path, items: Path) -> Path:
    out = tmp_path_factory.mktemp("fresh-fixed") / "run"
    run_ok("fixed-prefix", out, model, items, "--n", N, "--dtypes", "bf16,fp32")
    return out


@pytest.fixture(scope="module")
def fresh_bridge(tmp_path_factory: pytest.TempPathFactory, model: Path, items: Path) -> Path:
    out = tmp_path_factory.mktemp("fresh-bridge") / "run"
    run_ok("bridge", out, model, items, "--n", N, "--dtypes", "bf16,fp32")
    return out


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    return list(reader.fieldnames or []), list(reader)


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


def manifest(run: Path) -> dict[str, Any]:
    return json.loads((run / "manifest.json").read_text())


def is_subsequence(needle: list[str], haystack: list[str]) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


def strip(data: Any, drop: set[str]) -> Any:
    if isinstance(data, dict):
        return {k: strip(v, drop) for k, v in data.items() if k not in drop}
    if isinstance(data, list):
        return [strip(v, drop) for v in data]
    return data


def without(table: list[dict[str, str]], column: str) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k != column} for row in table]


# ---------------------------------------------------------------------------- schema


def test_hard_coded_headers_equal_the_paper_release() -> None:
    if not PAPER_DATA.is_dir():
        pytest.skip(f"{PAPER_DATA} is not present")
    for name, header in PAPER_HEADERS.items():
        with (PAPER_DATA / name).open(newline="", encoding="utf-8") as handle:
            assert next(csv.reader(handle)) == header, name


@pytest.mark.parametrize("experiment", ["matched", "fixed-prefix", "bridge"])
def test_files_and_paper_header_in_order(shared: Path, experiment: str) -> None:
    for name in ("manifest.json", "items.jsonl", "rows.jsonl", CSV_OF[experiment]):
        assert (shared / name).is_file(), name
    header, table = read_csv(shared / CSV_OF[experiment])
    paper = PAPER_HEADERS[CSV_OF[experiment]]
    assert is_subsequence(paper, header), set(paper) - set(header)
    assert len(header) == len(set(header))
    per_item = N if experiment == "bridge" else 2 * N
    assert len(table) == per_item
    _, problems = parse_rows(shared / "rows.jsonl", manifest(shared)["contract_sha256"])
    assert problems == []


def test_fresh_bridge_files_and_header(fresh_bridge: Path) -> None:
    header, table = read_csv(fresh_bridge / "live_teacher_bridge.csv")
    assert is_subsequence(PAPER_HEADERS["live_teacher_bridge.csv"], header)
    assert len(table) == N
    assert not (fresh_bridge / "matched_live_prefill.csv").exists()


# ----------------------------------------------------------------- what the rows show


@pytest.mark.parametrize("experiment", ["matched", "fixed-prefix"])
def test_matrix_replicas_exact_and_integrity(shared: Path, experiment: str) -> None:
    _, table = read_csv(shared / CSV_OF[experiment])
    left = "live" if experiment == "matched" else "incremental"
    for row in table:
        for arm in (left, "prefill"):
            for what in ("cache", "logits", "suffix"):
                assert row[f"{arm}_replica_{what}_exact"] == "true", (row["row_id"], arm, what)
            assert row[f"{arm}_suffix_sha256"] == row[f"{arm}_replica_suffix_sha256"]
        for column in ("functional_state_equal", "all_storage_disjoint", "integrity_pass"):
            assert row[column] == "true", (row["row_id"], column)
        assert re.fullmatch(r"[0-9a-f]{64}", row["source_row_sha256"])
    assert {(r["row_id"], r["precision"]) for r in table} == {
        (i, p) for i, _, _ in PROMPTS[:N] for p in ("bf16", "fp32")
    }


@pytest.mark.parametrize("which", ["shared", "fresh_bridge"])
def test_bridge_live_equals_replay_bit_for_bit(which: str, request: pytest.FixtureRequest) -> None:
    run: Path = request.getfixturevalue(which)
    _, table = read_csv(run / "live_teacher_bridge.csv")
    assert table
    for row in table:
        for column in (
            "live_teacher_cache_exact", "live_teacher_logits_exact", "live_teacher_suffix_exact",
            "boundary_argmax_equal", "all_48_layers_exact", "live_clone_cache_exact",
            "live_clone_logits_exact", "teacher_clone_cache_exact",
            "teacher_clone_logits_exact", "functional_state_equal", "all_storage_disjoint",
            "integrity_pass",
        ):  # fmt: skip
            assert row[column] == "true", (row["row_id"], column)
        assert row["live_suffix_sha256"] == row["teacher_suffix_sha256"]
        assert row["num_layers"] == "3"
        assert row["precision"] == "bf16"  # the first of --dtypes
        assert row["first_suffix_divergence_index"] == ""
    bridge_rows = [r for r in rows(run) if r["experiment"] == "bridge"]
    for record in bridge_rows:
        arms = record["data"]["arms"]
        for key in ("cache_fingerprint", "logits_fingerprint", "suffix_sha256"):
            assert arms["live"][key] == arms["teacher"][key], key


def test_bridge_after_matched_uses_its_prefixes(shared: Path) -> None:
    _, table = read_csv(shared / "live_teacher_bridge.csv")
    by_key = {r["key"]: r for r in rows(shared)}
    for row in table:
        source = f"matched/{row['row_id']}/bf16"
        assert row["historical_source"] == source
        assert row["live_matches_historical_prefix"] == "true"
        assert row["historical_prefix_sha256"] == by_key[source]["data"]["prefix_sha256"]
        live = by_key[f"bridge/{row['row_id']}/bf16"]["data"]["arms"]["live"]
        assert live["reused_from"] == source  # the matched live suffix, not decoded again
    selection = manifest(shared)["experiments"]["bridge"]["config"]["selection"]
    assert selection == {"rule": "outcome_blind_length_spread", "basis": "matched_prefix", "n": N}


def test_bridge_alone_selects_by_prompt_length(fresh_bridge: Path) -> None:
    _, table = read_csv(fresh_bridge / "live_teacher_bridge.csv")
    assert {r["historical_source"] for r in table} == {"none"}
    config = manifest(fresh_bridge)["experiments"]["bridge"]["config"]
    assert config["selection"]["basis"] == "prompt_tokens"
    assert config["dtype"] == "bf16"
    assert sorted(config["item_ids"]) == sorted(r["row_id"] for r in table)


# ----------------------------------------------------------------- manifest contents


def test_manifest_contents(shared: Path, items: Path, model: Path) -> None:
    m = manifest(shared)
    contract = m["contract"]
    assert m["format"] == "kvreplay-run-v1"
    assert m["contract_sha256"] == sha256_json(contract)
    assert m["snapshots"] == "fingerprints only"
    info = contract["model_info"]
    assert re.fullmatch(r"[0-9a-f]{64}", info["model_digest"])
    assert info["model_digest"] == contract["run"]["model_digest"]
    assert info["num_layers"] == 3 and info["model_type"] == ARCH
    assert "model.safetensors" in info["digests"] and "config.json" in info["digests"]
    env = contract["environment"]
    assert env["torch"] == torch.__version__
    assert env["transformers"] == transformers.__version__
    assert env["numpy"] == numpy.__version__
    assert env["python"] and env["device"] == "cpu" and env["threads"] == 1
    assert set(env["dtype_contract"]) >= {"deterministic_algorithms", "float32_matmul_precision"}
    assert contract["run"]["plan"]["name"] == "short"
    assert contract["run"]["model"] == str(model)
    loaded = load_items(str(items))
    assert contract["items"] == {"source": str(items), "digest": items_digest(loaded), "count": 3}
    frozen = [json.loads(line) for line in (shared / "items.jsonl").read_text().splitlines()]
    assert [i["id"] for i in frozen] == [i for i, _, _ in PROMPTS]
    experiments = m["experiments"]
    assert list(experiments) == ["matched", "fixed-prefix", "bridge"]
    first_n = [i for i, _, _ in PROMPTS[:N]]
    assert experiments["matched"]["config"] == {
        "dtypes": ["bf16", "fp32"],
        "item_ids": first_n,
        "schema_version": 1,  # the CSV's schema (experiments/table.py)
    }
    assert experiments["fixed-prefix"]["config"]["item_ids"] == first_n
    assert experiments["fixed-prefix"]["config"]["prefix_dtype"] == "bf16"
    for entry in experiments.values():
        assert entry["config_sha256"] == sha256_json(entry["config"])
        assert entry["engine"]["engine"] == "local"
    assert all(r["contract"] == m["contract_sha256"] for r in rows(shared))


# ------------------------------------------------------- fixed-prefix reuse is exact


def test_fixed_prefix_reuses_matched_prefixes(shared: Path) -> None:
    by_key = {r["key"]: r for r in rows(shared)}
    for item_id, _, _ in PROMPTS[:N]:
        matched = by_key[f"matched/{item_id}/bf16"]
        prefix = by_key[f"fixed-prefix/prefix/{item_id}"]["data"]
        assert prefix["source"] == {
            "key": matched["key"],
            "row_sha256": sha256_json(matched["data"]),
        }
        assert prefix["prefix_token_ids"] == matched["data"]["prefix_token_ids"]
        bf16 = by_key[f"fixed-prefix/{item_id}/bf16"]["data"]
        assert bf16["arms"]["prefill"]["reused_from"] == matched["key"]
        assert bf16["prefix_sha256"] == matched["data"]["prefix_sha256"]
        for dtype in ("bf16", "fp32"):
            arms = by_key[f"fixed-prefix/{item_id}/{dtype}"]["data"]["arms"]
            assert "reused_from" not in arms["prefill_replica"]  # replicas never reuse
            assert "reused_from" not in arms["left_replica"]
            assert arms["left"]["construction"] == "replay"
    _, table = read_csv(shared / "fixed_prefix_2x2.csv")
    for row in table:  # the CSV's source row is the matched row the prefix came from
        source = by_key[f"matched/{row['row_id']}/bf16"]
        assert row["source_row_sha256"] == sha256_json(source["data"])


def test_fixed_prefix_reuse_gives_the_same_results_as_a_fresh_run(
    shared: Path, fresh_fixed: Path
) -> None:
    def fixed(run: Path) -> dict[str, dict[str, Any]]:
        return {
            r["key"]: strip(r["data"], PROVENANCE)
            for r in rows(run)
            if r["experiment"] == "fixed-prefix"
        }

    reused, fresh = fixed(shared), fixed(fresh_fixed)
    assert list(reused) == list(fresh)
    for key in reused:
        assert reused[key] == fresh[key], key
    for key, data in fresh.items():
        if "arms" in data:  # spell out the fingerprints the claim rests on
            for arm in data["arms"]:
                for field in ("cache_fingerprint", "logits_fingerprint", "suffix_sha256"):
                    assert data["arms"][arm][field] == reused[key]["arms"][arm][field]
    header_a, table_a = read_csv(shared / "fixed_prefix_2x2.csv")
    header_b, table_b = read_csv(fresh_fixed / "fixed_prefix_2x2.csv")
    assert header_a == header_b
    assert without(table_a, "source_row_sha256") == without(table_b, "source_row_sha256")
    fresh_prefix = rows(fresh_fixed)[0]["data"]
    assert fresh_prefix["source"] == {"key": "fixed-prefix/prefix/a1", "generated": True}


# ------------------------------------------------------------------ terminal, analyze


def test_rerun_of_a_complete_run_adds_nothing(shared: Path, model: Path, items: Path) -> None:
    before = (shared / "rows.jsonl").read_bytes()
    csv_before = (shared / "matched_live_prefill.csv").read_bytes()
    result = run_ok("matched", shared, model, items, "--n", N, "--dtypes", "bf16,fp32")
    assert (shared / "rows.jsonl").read_bytes() == before
    assert (shared / "matched_live_prefill.csv").read_bytes() == csv_before
    assert "matched: live vs prefill" in result.stdout
    assert "bf16" in result.stdout and "fp32" in result.stdout
    assert f"Ledger: {shared}" in result.stdout


def test_analyze_the_run_folder(shared: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("kvreplay.analysis") is None:
        pytest.skip("kvreplay.analysis is not importable")
    out = tmp_path / "claims.json"
    result = invoke("analyze", shared, "--output", out)
    assert result.exit_code == 0, result.output
    claims = json.loads(out.read_text())
    assert claims
    assert "matched_live_prefill bf16" in result.stdout
