"""llama.cpp as both halves of the llamacpp backend reach it (its settings and checks in
:mod:`kvreplay.backends.llamacpp`, its model and states in
:mod:`kvreplay.backends.llamacpp_runtime`): llama-cpp-python's ctypes module, loaded on
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
