"""llama.cpp as both halves of the llamacpp backend reach it (its settings and checks in
:mod:`kvreplay.backends.llamacpp`, its model and states in
:mod:`kvreplay.backends.llamacpp.runtime`): llama-cpp-python's ctypes module, loaded on
first use, and the KV-cache types a run's precision names. No torch."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import INSTALL

LLAMACPP_SETUP = (
    "The llamacpp backend needs llama.cpp, which is not built in this environment; install "
    f"it with: {INSTALL['llamacpp']} (in a checkout: `make setup-llamacpp`; see "
    "docs/backends/llamacpp.md)."
)
# ggml's AMX kernels repack the weights and crash in the first matrix product (llama.cpp
# #20824): a build that enables them is refused rather than left to die in a worker.
CRASHING_KERNELS = ("AMX_INT8",)
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# A run's precision names the KV-cache type: its GGML type id.
KV_TYPES = {"fp32": 0, "fp16": 1, "bf16": 30, "q8_0": 8}


def binding() -> Any:
    """llama-cpp-python's ctypes module, with llama.cpp's own log kept to errors."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise KvreplayError(LLAMACPP_SETUP)
    try:
        import llama_cpp.llama_cpp as lib
    except (OSError, RuntimeError, FileNotFoundError) as exc:  # the library is not built
        raise KvreplayError(LLAMACPP_SETUP) from exc
    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
    return lib


def system_info() -> str:
    """llama.cpp's own line of the kernel families its build uses (``SSE3 = 1 | AVX2 = 1 |
    ...``), as it prints it at start: what a run records of its kernels."""
    return " ".join(binding().llama_print_system_info().decode("ascii", "replace").split())


def check_kernels(info: str) -> None:
    """Refuse a build whose system info enables a kernel family known to crash."""
    enabled = [name for name in CRASHING_KERNELS if f"{name} = 1" in info]
    if enabled:
        raise KvreplayError(
            f"This llama.cpp build enables ggml's {', '.join(enabled)} kernels, which crash "
            "in the first matrix product (llama.cpp #20824); rebuild llama-cpp-python with "
            f"{NO_AMX_FLAGS} in CMAKE_C_FLAGS and CMAKE_CXX_FLAGS (make setup-llamacpp "
            "builds it so)."
        )
