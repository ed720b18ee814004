"""Evidence across CPUs (issue 48): a run recorded on torch's portable kernels
(``ATEN_CPU_CAPABILITY=default``, a platform every x86 CPU can also run) audited on this
CPU's own kernels. Pinned to the recorder's capability, the re-execution must match bit
for bit; not pinned, it is judged at the level that crosses platforms, the honest run
passes and a forged token where the model was sure is still named. Nothing here rests
on one kernel family: where the two families agree the rows are simply equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forgery import audit, problems, read_rows, rechain
from safetensors.torch import load_file, save_file
from tiny import save_tiny

import kvreplay.audit.platform as platform_module
from kvreplay.backends.base import NEAR_TIE
from kvreplay.core.canonical import sha256_json

NATIVE = torch.backends.cpu.get_cpu_capability()


def sure_of_itself(folder: Path, factor: float = 40.0) -> Path:
    """A tiny model whose logits are ``factor`` times wider (its final norm scaled), so
    that its greedy choices are clear rather than the random model's near ties."""
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * factor
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def portable_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A matched run (bf16 and fp32) made by a process on torch's portable kernels."""
    root = tmp_path_factory.mktemp("portable")
    model = sure_of_itself(save_tiny(root / "model", "qwen2"))
    out = root / "run"
    command = [sys.executable, "-c", "from kvreplay.cli import main; main()", "run", "matched",
               "--model", str(model), "--plan", "short", "--dtypes", "bf16,fp32",
               "--n", "3", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    recorded = json.loads((out / "manifest.json").read_text())["contract"]["environment"]
    assert recorded["cpu_capability"] == "DEFAULT" and "cpu_features" in recorded
    return out


@pytest.mark.skipif(NATIVE == "DEFAULT", reason="this CPU runs torch's portable kernels")
def test_an_audit_pins_torch_to_the_recorded_capability_and_matches_bit_for_bit(
    portable_run: Path,
) -> None:
    result = audit(portable_run)
    assert result.exit_code == 0, result.output
    assert "torch's kernels pinned to default" in result.stdout
    assert "re-executed rows compared bit for bit" in result.stdout
    assert "PASS: every re-executed row" in result.stdout


@pytest.fixture
def unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auditor who cannot run the recorder's kernels (as an AVX2 CPU cannot run
    AVX-512's): the rows are re-executed on this CPU's own."""
    monkeypatch.setattr(platform_module, "pin_for", lambda recorded, here: {})


@pytest.mark.skipif(NATIVE == "DEFAULT", reason="this CPU runs torch's portable kernels")
def test_an_honest_run_passes_across_platforms(portable_run: Path, unpinned: None) -> None:
    result = audit(portable_run)
    assert result.exit_code == 0, result.output
    assert "platform: differs from the recorder's in cpu_capability" in result.stdout
    assert "across platforms: " in result.stdout
    assert "PASS: every hash and derived CSV matches, and every re-executed row" in result.stdout


def forge_a_sure_token(run: Path) -> str:
    """A forger's edit that every structural check accepts: in an fp32 row, one suffix
    token that every arm shares, where the recorded margin is wide, replaced in every
    arm (tokens, their hash), the chain rehashed and the CSV re-derived."""
    rows = read_rows(run)
    for row in rows:
        data = row["data"]
        if row["experiment"] != "matched" or data["precision"] != "fp32":
            continue
        arms = data["arms"]
        segments = [arm["suffix"]["segments"][0] for arm in arms.values()]
        steps = min(len(s["token_ids"]) for s in segments)
        for step in range(1, steps):
            shared = {s["token_ids"][step] for s in segments}
            wide = min(s["margins"][step] for s in segments) > 4 * NEAR_TIE["fp32"]
            early = all(m > NEAR_TIE["fp32"] for s in segments for m in s["margins"][:step])
            if len(shared) != 1 or not wide or not early:
                continue
            token = shared.pop()
            forged = 65 if token != 65 else 66
            for arm in arms.values():
                arm["suffix"]["segments"][0]["token_ids"][step] = forged
                arm["suffix_token_ids"][step] = forged
                arm["suffix_sha256"] = sha256_json(arm["suffix_token_ids"])
            rechain(run, rows)
            return f"{row['key']}: field arms."
    pytest.skip("no fp32 step here is wide enough for every arm")


@pytest.mark.skipif(NATIVE == "DEFAULT", reason="this CPU runs torch's portable kernels")
def test_a_forged_token_is_named_across_platforms(
    portable_run: Path, unpinned: None, tmp_path: Path
) -> None:
    run = tmp_path / "forged"
    subprocess.run(["cp", "-r", str(portable_run), str(run)], check=True)
    named = forge_a_sure_token(run)
    result = audit(run)
    assert result.exit_code == 1, result.output
    found = [p for p in problems(result) if named in p and "not the platform's rounding" in p]
    assert found, problems(result)
