"""The llamacpp backend end to end through the CLI, on the embedded SmolLM2 GGUF as
shipped (Q4_1 weights) with the ``short`` plan, KV caches in fp16 and fp32 (panels take
their prefixes from fp16 rows, llama.cpp's default KV type): matched rows whose replicas
are exact and whose states share no memory, the live-teacher bridge bit-exact, a K/V
transplant that recovers its donor, localize on a divergent row, audit passing and a
forged row caught, and bad input refused in one sentence. Needs ``make setup-llamacpp``
(``make test`` runs it)."""

from __future__ import annotations

import csv
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from forgery import assert_named, audit, read_rows, rechain
from helpers import invoke
from safetensors import safe_open
from safetensors.torch import save_file

from kvreplay.backends.llamacpp import LlamaCppBackend
from kvreplay.backends.llamacpp.runtime import LlamaState, Runtime
from kvreplay.model.identity import file_digests
from kvreplay.model.sources import gguf_file
from kvreplay.model.state import bit_equal

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _llamacpp(smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not LlamaCppBackend().installed():
        pytest.fail("llama.cpp is not built here; run `make setup-llamacpp`.")
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    yield


def run(out: Path, experiment: str, *extra: object) -> None:
    result = invoke(
        "run", experiment, "--backend", "llamacpp", "--plan", "short", "--out", out, *extra
    )
    assert result.exit_code == 0, result.output


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def matched(tmp_path_factory: pytest.TempPathFactory, smollm2_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("llamacpp") / "matched"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
        run(out, "matched", "--n", "3", "--dtypes", "fp16,fp32")
    return out


def test_matched_rows_have_exact_disjoint_replicas_and_record_the_gguf(matched: Path) -> None:
    lines = rows(matched / "matched_live_prefill.csv")
    assert [line["precision"] for line in lines] == ["fp16"] * 3 + ["fp32"] * 3
    for line in lines:
        for arm in ("live", "prefill"):
            for gate in ("cache_exact", "logits_exact", "suffix_exact"):
                assert line[f"{arm}_replica_{gate}"] == "true", (line["row_id"], arm, gate)
        assert line["all_storage_disjoint"] == "true"
        assert line["functional_state_equal"] == "true"
        assert line["integrity_pass"] == "true"
    contract = json.loads((matched / "manifest.json").read_text())["contract"]
    assert contract["run"]["backend"]["name"] == "llamacpp"
    assert contract["run"]["backend"]["n_ubatch"] == contract["run"]["backend"]["n_ctx"]
    assert list(contract["model_info"]["digests"]) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert "llama_cpp_python" in contract["environment"]
    print("llamacpp matched suffix_equal:", [line["suffix_equal"] for line in lines])


def test_audit_passes_and_catches_a_forged_suffix(matched: Path, tmp_path: Path) -> None:
    result = audit(matched)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    forged = tmp_path / "forged"
    forged.mkdir()
    for name in ("manifest.json", "items.jsonl", "rows.jsonl", "matched_live_prefill.csv"):
        (forged / name).write_bytes((matched / name).read_bytes())
    records = read_rows(forged)
    arm = records[0]["data"]["arms"]["prefill"]
    arm["suffix_sha256"] = "0" * 64
    rechain(forged, records)
    assert_named(audit(forged), "prefill")


def test_a_snapshot_layout_edited_where_the_backend_cannot_say_it(tmp_path: Path) -> None:
    """Issue 34 item 9: llama.cpp's cache layout is known only to a loaded model, so the
    audit holds every snapshot of a precision to one layout and every layer to the
    prefix: a kinds edit and a layer past the prefix are named without re-execution."""
    out = tmp_path / "snapshots"
    run(out, "matched", "--n", "2", "--dtypes", "fp16", "--save-snapshots")
    assert audit(out, "--sample", 0).exit_code == 0
    records = read_rows(out)
    for record, field, value in (
        (records[0], "layer_kinds", lambda m: m.replace("llama.cpp:1:1", "llama.cpp:0:0")),
        (records[1], "layer_lengths", lambda m: json.dumps([n + 1 for n in json.loads(m)])),
    ):
        arm = record["data"]["arms"]["prefill"]
        path = out / arm["snapshot"]["file"]
        with safe_open(str(path), "pt") as handle:
            metadata = dict(handle.metadata())
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
        metadata[field] = value(metadata[field])
        save_file(tensors, str(path), metadata=metadata)
        arm["snapshot"]["sha256"] = file_digests(path.parent, [path])[path.name]
    rechain(out, records)
    result = audit(out, "--sample", 0)
    assert_named(result, f"row {records[0]['key']}", "field layer_kinds of its metadata")
    assert_named(result, f"row {records[1]['key']}", "field layer_lengths of its metadata")


def test_bridge_is_bit_exact_on_llamacpp(tmp_path: Path) -> None:
    out = tmp_path / "bridge"
    run(out, "bridge", "--n", "2", "--dtypes", "fp16")
    for line in rows(out / "live_teacher_bridge.csv"):
        assert line["live_teacher_cache_exact"] == "true"
        assert line["live_teacher_logits_exact"] == "true"
        assert line["live_teacher_suffix_exact"] == "true"


def test_a_transplant_recovers_its_donor(matched: Path, tmp_path: Path) -> None:
    out = tmp_path / "transplant"
    run(out, "transplant", "--from", matched, "--panel", "blind", "--n", "2", "--dtypes", "bf16")
    lines = rows(next(out.glob("kv_transplant_*.csv")))
    assert lines
    for line in lines:
        assert line["all_48_layer_pairs_transplanted"] == "true"
        assert line["bidirectional_donor_recovery"] == "true"
        assert line["integrity_pass"] == "true"


def test_localize_sweeps_the_layers_of_a_divergent_row(matched: Path, tmp_path: Path) -> None:
    """Localize takes the matched run's divergent fp16 rows; its probes, claims, report
    and audit are those of any backend with K/V access."""
    divergent = {
        line["row_id"]
        for line in rows(matched / "matched_live_prefill.csv")
        if line["precision"] == "fp16" and line["suffix_equal"] == "false"
    }
    if not divergent:
        pytest.fail("No fp16 row of the matched run diverges on this CPU; localize needs one.")
    out = tmp_path / "localize"
    run(out, "localize", "--from", matched, "--dtypes", "fp16")
    probes = rows(out / "localize.csv")
    assert {p["row_id"] for p in probes} == divergent
    assert {p["direction"] for p in probes} == {"incremental_cache_into_prefill"}
    layers = int(probes[0]["num_layers"])
    singles = sorted(int(p["layers"]) for p in probes if p["sweep"] == "single")
    assert singles == sorted(list(range(layers)) * len(divergent))
    assert {p["component"] for p in probes if p["sweep"] == "component"} == {"k", "v"}
    for probe in probes:
        recovers = probe["recovers_donor"] == "true"
        assert recovers == (probe["first_divergence_index"] == "") == (probe["suffix_sha256"] != "")
        if probe["sweep"] == "prefix" and probe["layer_count"] == str(layers):
            assert recovers, "the full transplant is the donor's cache, bit for bit"
    assert (out / "figures" / "localize.png").is_file()

    analysed = invoke("analyze", out)
    assert analysed.exit_code == 0, analysed.output
    section = json.loads((out / "claims.json").read_text())["localize"]
    assert (section["precision"], section["num_layers"]) == ("fp16", layers)
    assert section["rows"] == len(divergent)
    report = invoke("report", out, "-o", tmp_path / "report")
    assert report.exit_code == 0, report.output
    assert "## Localize" in (tmp_path / "report" / "report.md").read_text()
    result = audit(out)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout


def test_a_states_kv_follow_every_change_of_its_context() -> None:
    """A context parses its sequence state once per change: advancing, splicing a donor's
    rows in and restoring a snapshot must each show the new K/V, not the parsed ones."""
    runtime = Runtime(gguf_file("smollm2-135m"), 2048, "off", threads=1, kv="fp16")
    ids = runtime.tokenize("Compute 3 + 4 * 5 step by step.", add_special=True)
    state, donor = LlamaState.empty(runtime, "live"), LlamaState.empty(runtime, "donor")
    state.advance(runtime, ids)
    donor.advance(runtime, ids[::-1] + ids[:1])
    before = state.layer_tensors()
    assert state.layer_lengths() == [len(ids)] * len(before)

    state.advance(runtime, ids[:1])
    assert state.layer_lengths() == [len(ids) + 1] * len(before)
    keys, values = state.layer_tensors()[0]
    assert keys.shape[0] == values.shape[0] == len(ids) + 1
    assert bit_equal(keys[: len(ids)], before[0][0])

    state.take_layers(donor, [0], "k")
    spliced_keys, spliced_values = state.layer_tensors()[0]
    assert bit_equal(spliced_keys, donor.layer_tensors()[0][0])
    assert not bit_equal(spliced_keys, keys) and bit_equal(spliced_values, values)

    donor.cache.restore(state.cache.snapshot())
    assert all(
        bit_equal(a, b)
        for pair_a, pair_b in zip(donor.layer_tensors(), state.layer_tensors(), strict=True)
        for a, b in zip(pair_a, pair_b, strict=True)
    )


def _one_sentence(args: list[object]) -> str:
    result = invoke("run", "matched", "--backend", "llamacpp", "--plan", "short", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.count("\n") == 0, message
    return message


def test_a_missing_truncated_or_unloadable_gguf_is_refused(tmp_path: Path) -> None:
    missing = _one_sentence(["--out", tmp_path / "a", "--model", tmp_path / "none.gguf"])
    assert "does not exist" in missing
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 0))
    _one_sentence(["--out", tmp_path / "b", "--model", truncated])
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_settings_llamacpp_cannot_run_with_are_refused(tmp_path: Path) -> None:
    assert "--n-ctx" in _one_sentence(["--out", tmp_path / "a", "--n-ctx", "8"])
    assert "--flash-attn" in _one_sentence(["--out", tmp_path / "b", "--flash-attn", "maybe"])
    assert "--block-size" in _one_sentence(["--out", tmp_path / "c", "--block-size", "64"])


def test_a_q8_0_kv_cache_runs_with_flash_attention_only(tmp_path: Path) -> None:
    refusal = _one_sentence(["--out", tmp_path / "a", "--dtypes", "q8_0"])
    assert "--flash-attn on" in refusal
    out = tmp_path / "q8"
    run(out, "matched", "--n", "1", "--dtypes", "q8_0", "--flash-attn", "on")
    (line,) = rows(out / "matched_live_prefill.csv")
    assert line["precision"] == "q8_0"
    assert line["live_replica_cache_exact"] == line["prefill_replica_cache_exact"] == "true"
    assert (
        json.loads((out / "manifest.json").read_text())["contract"]["run"]["backend"]["flash_attn"]
        == "on"
    )
    assert audit(out).exit_code == 0


def test_the_hf_backend_refuses_a_kv_cache_type(tmp_path: Path) -> None:
    result = invoke("run", "matched", "--out", tmp_path / "a", "--dtypes", "q8_0")
    assert result.exit_code == 2
    assert "Unknown dtype 'q8_0'; choose one of fp32, bf16, fp16." in result.stderr
