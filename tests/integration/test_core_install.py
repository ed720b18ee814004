"""The core install (``pip install kvreplay``: no torch, no transformers) run as its user
runs it: the ``kvreplay`` of the core environment (``make setup-core``) in a subprocess.
No torch there; every backend listed with the command that installs it; a missing
backend refused in one sentence naming that command; and analyze and report of committed
runs deriving, byte for byte, what this environment derives. Checks over HTTP against real
servers run beside the servers the suite already starts (``test_http_backend.py``,
``test_llamacpp_server.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import CORE_VENV, core, invoke

pytestmark = pytest.mark.core
REPO = Path(__file__).resolve().parents[2]


def test_the_core_environment_has_no_torch_and_runs_kvreplay() -> None:
    version = core("--version")
    assert version.returncode == 0 and "0.1.0" in version.stdout
    for module in ("torch", "transformers", "accelerate", "gguf"):
        found = subprocess.run([CORE_VENV / "bin" / "python", "-c", f"import {module}"])
        assert found.returncode != 0, f"{module} is importable in the core environment"


def test_backends_name_the_command_that_installs_each_missing_one() -> None:
    listed = core("backends")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    for name, command in (
        ("hf", "pip install 'kvreplay[hf]'"),
        ("vllm", "pip install 'kvreplay[vllm]' vllm"),
        ("llamacpp", "pip install 'kvreplay[llamacpp]'"),
    ):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} ("))
        assert lines[at].startswith(f"{name} (not installed here)")
        assert lines[at + 1] == f"  install: {command}"
    assert any(line.startswith("http (installed)") for line in lines)


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (("run", "matched", "--backend", "hf"), "The hf backend needs torch and transformers"),
        (("check",), "The hf backend needs torch and transformers"),
        (("run", "resample", "--backend", "vllm"), "The vllm backend needs vLLM"),
        (("run", "matched", "--backend", "llamacpp"), "The llamacpp backend needs llama.cpp"),
    ],
)
def test_selecting_a_missing_backend_is_refused_in_one_sentence(
    args: tuple[str, ...], sentence: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    refused = core(*args, "--out", out)
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert sentence in refused.stderr
    assert "with: pip install 'kvreplay[" in refused.stderr
    assert "Traceback" not in refused.stderr and not out.exists()


@pytest.mark.parametrize("run", ["smollm2-n24", "smollm2-http-n24-bf16", "smollm2-vllm-n24"])
def test_analyze_and_report_derive_what_this_environment_derives(run: str, tmp_path: Path) -> None:
    """The committed run's claims byte for byte, and its report and figures as the full
    install makes them (an hf, an http and a vLLM run)."""
    folder = REPO / "results" / run
    core_out, full_out = tmp_path / "core", tmp_path / "full"
    core_out.mkdir()
    analyzed = core("analyze", folder, "-o", core_out / "claims.json")
    assert analyzed.returncode == 0, analyzed.stderr
    assert (core_out / "claims.json").read_bytes() == (folder / "claims.json").read_bytes()
    reported = core("report", folder, "-o", core_out / "report")
    assert reported.returncode == 0, reported.stderr
    assert invoke("report", folder, "-o", full_out).exit_code == 0
    made = sorted(p.relative_to(full_out) for p in full_out.rglob("*") if p.is_file())
    assert made and made == sorted(
        p.relative_to(core_out / "report") for p in (core_out / "report").rglob("*") if p.is_file()
    )
    for path in made:
        assert (core_out / "report" / path).read_bytes() == (full_out / path).read_bytes(), path
