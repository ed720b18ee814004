"""Contracts recorded in an older layout, read as this kvreplay writes them (one step).

Runs made before every backend was named in its contract recorded the attention
implementation and the remote-code switch beside the model, for every backend, and an
hf run named no backend at all. Today each is a setting of the backends that take it
(hf: both; vllm: remote code) inside ``run.backend``. :func:`current` moves them there,
so that a resume and an audit compare a recorded contract with a freshly built one
field by field, and every reader sees one layout; the recorded bytes (and so every
row's contract hash) stay as they were.
"""

from __future__ import annotations

from typing import Any

from kvreplay.backends import backend_class

# The settings the old layout held beside the model.
MOVED = ("attn_implementation", "trust_remote_code")
UNNAMED_BACKEND = "hf"
"""What ran a contract that names no backend: transformers, the only backend there was
before contracts named theirs. A fact about those runs, so it never follows today's
default backend."""


def current_run(run: dict[str, Any]) -> dict[str, Any]:
    """A contract's ``run`` entry in today's layout (unchanged when it already is)."""
    if "backend" in run and not any(key in run for key in MOVED):
        return run
    upgraded = {key: value for key, value in run.items() if key not in MOVED}
    backend = dict(run.get("backend") or {"name": UNNAMED_BACKEND})
    takes = backend_class(backend["name"]).settings()
    for key in MOVED:
        if key in run and key in takes:
            backend.setdefault(key, run[key])
    upgraded["backend"] = backend
    return upgraded


def current(contract: dict[str, Any]) -> dict[str, Any]:
    """A whole contract in today's layout (see :func:`current_run`)."""
    run = contract.get("run")
    return {**contract, "run": current_run(run)} if isinstance(run, dict) else contract
