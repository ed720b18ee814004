"""What the machine and libraries were when a run was made: the part that can change a
bf16 result goes into the run's contract, the rest into the manifest's header.

Contract scheme 1 (runs made before scheme 2) recorded ``platform``, whose kernel build
string changes between otherwise identical machines; scheme 2 records instead what
chooses the kernels (machine, OS, libc, torch's CPU capability). A difference in a field
listed in ``INFORMATIONAL`` is reported, never refused. Scheme 3 records the environment
as scheme 2 does and the model under identity scheme 3 (see ``identity.ModelIdentity``):
a contract's scheme is also its model identity's.

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
