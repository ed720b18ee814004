"""Every CPU family (issue 48): what a contract records of the CPU, llama.cpp built without
the AMX kernels that crash, and torch's bf16 flash attention avoided where it cannot run
(a CPU with AMX below torch's AVX-512 kernels). The machine running this suite may have
none of these CPUs: their conditions are set here, and what the machine has is checked
as it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kvreplay.contract.environment as environment
from kvreplay.backends.hf import HfBackend
from kvreplay.backends.hf.loading import cpu_flash_unusable, load_model
from kvreplay.core.errors import KvreplayError

REPO = Path(__file__).resolve().parents[2]
SAPPHIRE_RAPIDS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f "
    "avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 sha_ni\n\n"
    "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n"
)


def test_the_contract_records_the_cpus_vendor_and_kernel_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(SAPPHIRE_RAPIDS)
    monkeypatch.setattr(environment, "CPUINFO", cpuinfo)
    assert environment.cpu() == {
        "cpu_vendor": "GenuineIntel",
        "cpu_features": "avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 "
        "amx_tile amx_bf16 amx_int8",
    }
    assert "cpu_features" in environment.environment("cpu", scheme=4)
    assert "cpu_features" not in environment.environment("cpu", scheme=3)
    monkeypatch.setattr(environment, "CPUINFO", tmp_path / "missing")
    assert environment.cpu() == {"cpu_vendor": "", "cpu_features": ""}


def test_the_llamacpp_build_script_turns_amx_off_whatever_the_cpu() -> None:
    script = (REPO / "requirements" / "build-llamacpp.sh").read_text()
    for flags in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        line = re.search(rf'"-D{flags}=([^"]*)"', script)
        assert line and set(line.group(1).split()) >= {
            "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"
        }  # fmt: skip


def test_the_built_llamacpp_enables_no_amx_kernel() -> None:
    """llama.cpp's own system info for the build this environment loads."""
    from kvreplay.backends.llamacpp.binding import check_kernels, system_info

    try:
        info = system_info()
    except KvreplayError:
        pytest.skip("llama.cpp is not built here (make setup-llamacpp)")
    assert "AMX" not in info, info
    check_kernels(info)
    with pytest.raises(KvreplayError, match="enables ggml's AMX_INT8 kernels, which crash"):
        check_kernels(info + " AMX_INT8 = 1 |")


@pytest.fixture
def amx_below_avx512(monkeypatch: pytest.MonkeyPatch):
    """A CPU with AMX tiles running torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    enabled = torch.backends.cuda.flash_sdp_enabled()
    yield
    torch.backends.cuda.enable_flash_sdp(enabled)


def test_flash_attention_is_usable_unless_amx_meets_lower_kernels(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_flash_unusable()
    assert HfBackend().kernels() is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not cpu_flash_unusable()


def test_there_the_hf_backend_runs_sdpas_math_kernel_and_says_so(
    amx_below_avx512: None, tiny_dirs: dict[str, Path]
) -> None:
    assert cpu_flash_unusable()
    assert "sdpa math on CPU" in (HfBackend().kernels() or "")
    assert HfBackend(attn_implementation="eager").kernels() is None
    load_model(str(tiny_dirs["qwen2"]), "bf16", "cpu", "sdpa")
    assert not torch.backends.cuda.flash_sdp_enabled()
