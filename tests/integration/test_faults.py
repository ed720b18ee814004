"""The fault suite (issues 43, 50) on the engines that run in this environment: every
declared fault has its hook and the check option that catches it, a fault is enabled only
by what no run folder carries, a run made with one records it in its manifest's one field
and says so in its verdict (an audit under a planted fault refuses to judge), and the
check (or the option the declaration names) catches each planted fault while the clean
engine passes:

- hf, a tiny Qwen2 in fp32: ``hf-lossy-cache`` fails the token level;
- llama.cpp, the embedded SmolLM2 GGUF (slow): a perturbed or re-evaluated restore fails
  the replica gate of the default check, and a one-ulp prefill logit fails ``--expect
  bitwise`` with a q8_0 cache, which the clean engine holds bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import invoke, pool_inputs

from kvreplay.faults import FAULTS, planted
from kvreplay.faults.plugin import ENTRY, GROUP, register, write_plugin_folder
from kvreplay.faults.registry import ENV


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return pool_inputs(tmp_path_factory.mktemp("fault-inputs"))


def check(model: Path, inputs: tuple[Path, Path], out: Path, *extra: object):
    items, plan = inputs
    return invoke("check", "--model", model, "--items", items, "--plan", plan, "--n", 16,
                  "--dtypes", "fp32", "--out", out, *extra)  # fmt: skip


def test_every_fault_is_declared_once_with_its_hook() -> None:
    from kvreplay.core.registry import load
    from kvreplay.faults.registry import OPTIONS

    names = [fault.name for fault in FAULTS]
    assert len(names) == len(set(names)) >= 20
    for fault in FAULTS:
        assert fault.name.startswith(fault.engine + "-") and fault.shaped_like and fault.fires
        module, _, function = fault.hook.partition(":")
        assert module == f"{fault.engine}_engine", fault.name  # one engine module each
        assert callable(load(f"kvreplay.faults.{fault.hook}")), fault.name
        assert fault.caught_by in OPTIONS, fault.name
    default = [f for f in FAULTS if f.caught_by == "default"]
    assert len(default) >= 0.9 * len(FAULTS)  # the bare default check catches 90% or more


def test_the_vllm_plugin_does_nothing_unless_the_setting_names_a_vllm_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    register()  # no setting: nothing planted, vLLM never imported
    monkeypatch.setenv(ENV, "hf-lossy-cache")
    with pytest.raises(Exception, match="not a vLLM one"):
        register()
    monkeypatch.setenv(ENV, "no-such-fault")
    with pytest.raises(Exception, match="Unknown fault 'no-such-fault'"):
        register()
    folder = write_plugin_folder(tmp_path)
    entry = next(folder.glob("*.dist-info")) / "entry_points.txt"
    assert entry.read_text() == f"[{GROUP}]\n{ENTRY} = kvreplay.faults.plugin:register\n"


def test_hf_lossy_cache_fails_the_token_level_and_the_clean_engine_holds(
    tiny_dirs, inputs, tmp_path: Path
) -> None:
    from transformers.cache_utils import DynamicLayer

    update = DynamicLayer.update
    clean = check(tiny_dirs["qwen2"], inputs, tmp_path / "clean", "--n", 3)
    assert clean.exit_code == 0, clean.output
    with planted("hf-lossy-cache"):
        assert DynamicLayer.update is not update
        faulty = check(tiny_dirs["qwen2"], inputs, tmp_path / "faulty", "--n", 3)
    assert DynamicLayer.update is update  # off again after the block
    assert faulty.exit_code == 1, faulty.output
    # p2 parts at a margin of 5e-4 here: far above fp32 kernel noise, far below fp8's
    assert faulty.output.startswith("FAILS at token level"), faulty.output


def test_a_run_made_with_a_planted_fault_says_so_and_is_read_only_with_it(
    tiny_dirs, inputs, tmp_path: Path
) -> None:
    out, verdict = tmp_path / "run", tmp_path / "verdict.json"
    with planted("hf-lossy-cache"):
        faulty = check(tiny_dirs["qwen2"], inputs, out, "--n", 1, "--json", verdict)
        audit = invoke("audit", out)
    assert "with the fault hf-lossy-cache planted" in faulty.output.splitlines()[0]
    assert json.loads(verdict.read_text())["planted_fault"] == "hf-lossy-cache"
    assert json.loads((out / "manifest.json").read_text())["planted_fault"] == "hf-lossy-cache"
    # an audit under a planted fault refuses to judge; without it, the run is refused
    for result in (audit, invoke("audit", out), check(tiny_dirs["qwen2"], inputs, out, "--n", 1)):
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert "planted in this process, so an audit would judge the fault" in audit.output


def test_only_the_manifest_field_names_a_planted_fault(tiny_dirs, tmp_path: Path) -> None:
    """The switch's text anywhere else (an item id, a prompt, the command line, the
    folder's name) names nothing; the field, forged into a clean run, is refused."""
    items = tmp_path / "KVREPLAY_FAULT-items.jsonl"
    items.write_text(json.dumps({"id": "KVREPLAY_FAULT", "prompt": "KVREPLAY_FAULT=x 1+1=",
                                 "answer": "2"}) + "\n")  # fmt: skip
    out = tmp_path / "KVREPLAY_FAULT-run"
    first = invoke("check", "--model", tiny_dirs["qwen2"], "--items", items, "--plan", "short",
                   "--dtypes", "fp32", "--n", 1, "--out", out)  # fmt: skip
    assert first.exit_code == 0, first.output
    assert invoke("audit", out).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "planted_fault" not in manifest
    manifest["planted_fault"] = "hf-lossy-cache"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    refused = invoke("audit", out)
    assert refused.exit_code == 2 and "made with the planted fault hf-lossy-cache" in refused.output


@pytest.fixture
def smollm2_gguf(smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kvreplay.backends.llamacpp import LlamaCppBackend

    if not LlamaCppBackend().installed():
        pytest.fail("llama.cpp is not built here; run `make setup-llamacpp`.")
    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    yield


LLAMACPP = ("--backend", "llamacpp", "--plan", "short", "--n", 1)
Q8_0 = (*LLAMACPP, "--dtypes", "q8_0", "--flash-attn", "on", "--expect", "bitwise")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["llamacpp-restore-perturbed", "llamacpp-reeval-last"])
def test_a_faulty_llamacpp_restore_fails_the_replica_gate(
    fault: str, smollm2_gguf: None, tmp_path: Path
) -> None:
    with planted(fault):
        result = invoke("check", *LLAMACPP, "--dtypes", "fp16", "--out", tmp_path / "run")
    assert result.exit_code == 1, result.output
    assert (
        f"FAILS at token level (every suffix equal) with the fault {fault} planted: replicas "
        "disagreed on 1 of 1 item(s)"
    ) in result.output


@pytest.mark.slow
def test_a_one_ulp_prefill_logit_fails_bitwise_where_the_clean_engine_holds(
    smollm2_gguf: None, tmp_path: Path
) -> None:
    clean = invoke("check", *Q8_0, "--out", tmp_path / "clean")
    assert clean.exit_code == 0 and clean.output.startswith("HOLDS bitwise"), clean.output
    with planted("llamacpp-prefill-logits-ulp"):
        faulty = invoke("check", *Q8_0, "--out", tmp_path / "faulty")
    assert faulty.exit_code == 1, faulty.output
    first = faulty.output.splitlines()[0]
    assert first.startswith("FAILS bitwise") and "from step 0 (the boundary logits)" in first
    assert "continuations differ on 0 of 1" in first  # no token moved
