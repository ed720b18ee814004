"""The vllm backend (issue 13) end to end on a tiny Qwen2 that vLLM's CPU attention
serves (head size 32): ``matched`` rows with hit/miss arms and replicas, engine-reported
cached tokens, the paper's ledger with its K/V columns empty, analyze, report, audit
re-execution and a forged row caught. It runs in the vLLM environment (``make test`` runs
it there, see the Makefile); elsewhere it is deselected by its marker."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import QUICK, check, copy_model, invoke, run_args
from tiny import save_tiny

from kvreplay.backends import vllm as vllm_backend
from kvreplay.run import runner

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

KV_COLUMNS = (
    "live_prefill_cache_exact",
    "cache_max_abs_diff",
    "functional_state_equal",
    "all_storage_disjoint",
    "live_replica_cache_exact",
    "cache_relative_l2_by_layer",
)
CSV = "matched_live_prefill.csv"


@pytest.fixture(scope="module")
def served_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm")
    model = save_tiny(root / "model", "served_qwen2")
    out = root / "run"
    result = invoke("run", "matched", "--model", model, "--n", 3, "--plan", "short",
                    "--backend", "vllm", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(line)["data"] for line in (run / "rows.jsonl").read_text().splitlines()]


def test_rows_hold_hit_and_miss_arms_with_replicas(served_run: Path) -> None:
    data = rows(served_run)
    assert len(data) == 6 and {r["precision"] for r in data} == {"bf16", "fp32"}
    for row in data:
        arms = row["arms"]
        assert set(arms) == {"left", "left_replica", "prefill", "prefill_replica",
                             "uninterrupted", "batched"}  # fmt: skip
        assert arms["left"]["construction"] == "cache-hit"
        assert arms["prefill"]["construction"] == "cache-miss"
        hit = arms["left"]["served"]["cached_tokens"][0]
        # the hit reuses every full block of what the rewrite computed (P less its last
        # token, which was sampled, never fed); the miss reuses nothing
        assert hit == (row["prefix_token_count"] - 1) // 32 * 32 and hit > 0
        assert arms["left"]["served"]["expected_cached_tokens"] == hit
        assert arms["prefill"]["served"]["cached_tokens"][0] == 0
        assert arms["left"]["cache_fingerprint"] is None
        gates = row["replicas"]
        assert set(gates["left"]) == {"logits_exact", "suffix_exact", "cached_tokens_equal",
                                      "prefix_rewrites_exact", "cache_condition_met"}  # fmt: skip
        assert set(gates["prefill"]) == set(gates["left"]) - {"prefix_rewrites_exact"}
        assert all(all(gate.values()) for gate in gates.values())
        assert (
            arms["batched"]["served"]["companions"]
            == [  # n = 3: the two others, in turn
                f"r{(int(row['item_id'][1:]) + k) % 3:04d}" for k in (1, 2)
            ]
        )
        assert arms["batched"]["served"]["prefix_reproduced"] is True
        assert arms["uninterrupted"]["served"]["prefix_reproduced"] is True
        assert len(arms["uninterrupted"]["served"]["first_logprobs"]) >= 2


def test_ledger_leaves_kv_columns_empty(served_run: Path) -> None:
    with (served_run / CSV).open() as handle:
        lines = list(csv.DictReader(handle))
    assert len(lines) == 6
    for line in lines:
        assert line["backend"] == "vllm" and line["integrity_pass"] == "true"
        assert all(line[c] == "" for c in KV_COLUMNS)
        assert line["live_prefill_logits_exact"] in ("true", "false")
        assert int(line["live_cached_tokens"]) > 0 and line["prefill_cached_tokens"] == "0"


def test_manifest_records_engine_settings(served_run: Path) -> None:
    contract = json.loads((served_run / "manifest.json").read_text())["contract"]
    backend = contract["run"]["backend"]
    assert backend["name"] == "vllm" and backend["block_size"] == 32
    assert backend["enable_prefix_caching"] is True and backend["kv_access"] is True
    assert contract["environment"]["vllm"]


def test_analyze_and_report(served_run: Path) -> None:
    assert invoke("analyze", served_run).exit_code == 0
    claims = json.loads((served_run / "claims.json").read_text())
    assert set(claims["served_matched"]) == {"bf16", "fp32"}
    assert "cache_exact_rows" not in claims["matched_live_prefill"]["bf16"]
    assert invoke("report", served_run).exit_code == 0
    report = (served_run / "report.md").read_text()
    assert "Serving engine: prefix-cache hit vs miss" in report
    assert "cannot show how the cached K/V differ" in report


def test_audit_reexecutes_and_catches_a_forged_row(served_run: Path, tmp_path: Path) -> None:
    result = invoke("audit", served_run)
    assert result.exit_code == 0, result.output
    from kvreplay.core.canonical import sha256_json
    from kvreplay.experiments.matrix.table import SERVED_MATCHED_TABLE
    from kvreplay.ledger import GENESIS, Record

    forged = tmp_path / "forged"
    forged.mkdir()
    for name in ("manifest.json", "items.jsonl"):
        (forged / name).write_bytes((served_run / name).read_bytes())
    lines = [json.loads(x) for x in (served_run / "rows.jsonl").read_text().splitlines()]
    lines[0]["data"]["arms"]["left"]["served"]["cached_tokens"][0] += 32  # consistent forgery:
    lines[0]["data"]["arms"]["left"]["served"]["expected_cached_tokens"] += 32  # gate holds
    manifest = json.loads((forged / "manifest.json").read_text())
    contract = sha256_json(manifest["contract"])
    records, prev = [], GENESIS
    for seq, line in enumerate(lines):  # rechained, as a careful forger would
        record = Record(**{**line, "seq": seq, "prev": prev, "contract": contract})
        record.hash = record.expected_hash()
        records.append(record)
        prev = record.hash
    (forged / "rows.jsonl").write_text("".join(r.to_line() for r in records))
    config = manifest["experiments"]["matched"]["config"]
    (forged / CSV).write_text(SERVED_MATCHED_TABLE.csv(records, config))
    result = invoke("audit", forged)
    assert result.exit_code == 1
    assert f"row {lines[0]['key']}: field arms.left.served.cached_tokens" in result.output


def test_model_vllm_cannot_serve_is_refused(tmp_path: Path, tiny_dirs) -> None:
    out = tmp_path / "run"
    result = invoke("run", "matched", "--model", tiny_dirs["drift_qwen2"], "--backend", "vllm",
                    "--out", out)  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "vLLM cannot serve the model" in result.output
    assert not out.exists()


def _with_config(model: Path, **fields: object) -> Path:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | fields))
    return model


def test_what_the_engine_config_rules_out_is_refused_before_the_manifest(
    tmp_path: Path, tiny_dirs
) -> None:
    """Issue 34 item 7: vLLM's CPU attention has no kernel for head size 16 (the engine
    starts, then fails at the first request), and a config whose architecture vLLM runs
    as a pooling model generates nothing: both are read from vLLM's own engine config
    and attention backend, before the manifest, in one sentence."""
    pooling = _with_config(copy_model(tiny_dirs["qwen2"], tmp_path / "pooling"),
                           architectures=["BertModel"])  # fmt: skip
    for model, expected in (
        (tiny_dirs["qwen2"], f"serves head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, "
                             f"256, 512, and the model '{tiny_dirs['qwen2']}' has head size 16."),
        (pooling, f"vLLM would run the model '{pooling}' as a pooling model"),
    ):  # fmt: skip
        args, out = run_args("matched", tmp_path, model, ("--out", tmp_path / f"{model.name}-run"))
        check(invoke(*args, *QUICK, "--backend", "vllm"), expected, out)
        assert not (out / "manifest.json").exists()


def test_an_engine_failure_is_one_sentence_and_the_folder_stays_reusable(
    served_run: Path, tmp_path: Path, tiny_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the check before the manifest to miss what the engine cannot serve, the
    engine's own failure is one sentence, no row is recorded, and a rerun into the same
    folder with a model the engine serves completes."""
    monkeypatch.setattr(vllm_backend, "check_engine_config", lambda *args: None)
    # the tiny model's prefixes are shorter than a block: a run the runner refuses as
    # vacuous before the engine starts, which this test also takes as missed
    monkeypatch.setattr(runner, "_check_hits", lambda *args: None)
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    result = invoke(*args, *QUICK, "--backend", "vllm")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    # the run's progress bars come before it: the sentence is the last line
    last = result.stderr.splitlines()[-1]
    assert last.startswith("kvreplay: error: The vLLM engine failed on a request, so no row")
    assert "head_dim=16" in last
    assert not (out / "rows.jsonl").exists()
    args, out = run_args("matched", tmp_path, served_run.parent / "model")
    result = invoke(*args, *QUICK, "--backend", "vllm")
    assert result.exit_code == 0, result.output
    assert len(rows(out)) == 1


def test_ray_actor_holds_its_own_engine(served_run: Path, tmp_path: Path, monkeypatch) -> None:
    """``--engine ray --backend vllm``: the actor starts its own engine; rows equal the
    local engine's field by field (timing and worker aside)."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / "ray"
    model = served_run.parent / "model"
    result = invoke("run", "matched", "--model", model, "--n", 3, "--plan", "short",
                    "--backend", "vllm", "--engine", "ray", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    local = [json.loads(x) for x in (served_run / "rows.jsonl").read_text().splitlines()]
    distributed = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["data"] for r in local] == [r["data"] for r in distributed]
    assert {r["worker"] for r in distributed} == {"ray-0"}
    assert (served_run / CSV).read_bytes() == (out / CSV).read_bytes()


def test_resample_on_served_states(served_run: Path, tmp_path: Path) -> None:
    """``resample --backend vllm``: each seed is a request with its own seed from a hit
    and from a miss of P; replicas repeat the first seeds; the certificate is computed
    from the ledger and audit re-executes it."""
    out = tmp_path / "resample"
    model = served_run.parent / "model"
    result = invoke("run", "resample", "--model", model, "--n", 2, "--plan", "short",
                    "--dtypes", "bf16", "--samples", 3, "--replica-samples", 1,
                    "--backend", "vllm", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    for row in rows(out):
        samples = row["samples"]
        arms = ("live", "live_replica", "prefill", "prefill_replica")
        assert [len(samples[a]) for a in arms] == [3, 1, 3, 1]
        assert {s["construction"] for s in samples["live"]} == {"cache-hit"}
        assert all(s["served"]["cached_tokens"][0] > 0 for s in samples["live"])
        assert all(s["served"]["cached_tokens"][0] == 0 for s in samples["prefill"])
        assert all(gate["suffix_exact"] for gate in row["replicas"].values())
    with (out / "resample_live_prefill.csv").open() as handle:
        lines = list(csv.DictReader(handle))
    assert [line["backend"] for line in lines] == ["vllm", "vllm"]
    assert all(line["live_prefill_cache_exact"] == "" for line in lines)
    assert invoke("analyze", out).exit_code == 0
    claims = json.loads((out / "claims.json").read_text())
    assert claims["resample"]["bf16"]["verdict"] in ("faithful", "not faithful", "undecided")
    result = invoke("audit", out)
    assert result.exit_code == 0, result.output
