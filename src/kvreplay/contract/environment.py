"""What the machine and libraries were when a run was made: the part that can change a
bf16 result goes into the run's contract, the rest into the manifest's header.

Contract scheme 1 (runs made before scheme 2) recorded ``platform``, whose kernel build
string changes between otherwise identical machines; scheme 2 records instead what
chooses the kernels (machine, OS, libc, torch's CPU capability). A difference in a field
listed in ``INFORMATIONAL`` is reported, never refused. Scheme 3 records the environment
as scheme 2 does and the model under identity scheme 3 (see ``identity.ModelIdentity``).
Scheme 4 adds what else chooses kernels (design: evidence across CPUs): the CPU's vendor
and the instruction-set features that torch's oneDNN and MKL, vLLM's CPU extension and
attention kernel, and ggml pick their code paths by (AMX among them: torch's capability
string says AVX512 on a CPU with or without it), and each backend's own kernel report
(llama.cpp's system info). Scheme 4 keeps identity scheme 3.

The core install (no torch) runs only served backends, whose numerics are the server's:
its environment records no torch, and the library that tokenizes (``tokenizers``).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

from kvreplay.core.extras import missing
from kvreplay.ledger import CONTRACT_SCHEME

# CPU features that choose a kernel family somewhere below kvreplay (x86 flags and Arm
# features as /proc/cpuinfo names them); the rest of the flags change no numerics.
KERNEL_FEATURES = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip
CPUINFO = Path("/proc/cpuinfo")
KERNELS = "kernels"  # the environment's field of a backend's own kernel report


def cpu() -> dict[str, str]:
    """The CPU's vendor and its kernel-choosing features (``cpu_features``, in
    ``KERNEL_FEATURES`` order), from the first processor /proc/cpuinfo lists; empty
    strings where the system has no such file."""
    fields: dict[str, str] = {}
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("vendor_id", "CPU implementer", "flags", "Features") and name not in fields:
            fields[name] = value.strip()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    vendor = fields.get("vendor_id") or fields.get("CPU implementer") or ""
    return {
        "cpu_vendor": vendor,
        "cpu_features": " ".join(f for f in KERNEL_FEATURES if f in flags),
    }


def git_commit() -> str | None:
    """The kvreplay source checkout's commit, when it is one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def environment(device: str, scheme: int = CONTRACT_SCHEME) -> dict[str, Any]:
    """Library versions, device, kernel family and numeric flags: each can change bf16."""
    if missing("torch"):
        return core_environment(device)
    import numpy
    import torch
    import transformers

    machine: dict[str, Any] = (
        {"platform": platform.platform()}
        if scheme == 1
        else {
            "machine": platform.machine(),
            "system": platform.system(),
            "libc": "-".join(platform.libc_ver()),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **(cpu() if scheme >= 4 else {}),
        }
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        **machine,
        "device": device,
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "dtype_contract": {
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        },
    }


def core_environment(device: str) -> dict[str, Any]:
    """The core install's: the machine, and the libraries that tokenize and analyse."""
    import numpy
    import tokenizers

    return {
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
        "machine": platform.machine(),
        "system": platform.system(),
        "libc": "-".join(platform.libc_ver()),
        "device": device,
        "device_name": device_name(device),
    }
