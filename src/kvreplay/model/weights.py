"""Weights that cannot give a number: a tensor holding NaN or an infinity makes every
logit NaN, which no ledger can record (canonical JSON refuses it) and no comparison can
mean anything about. transformers loads such weights without a word; kvreplay reads each
tensor of a model's safetensors once, before a run writes anything, and refuses them."""

from __future__ import annotations

from pathlib import Path

from kvreplay.core.errors import KvreplayError


def check_finite_weights(folder: Path, spec: str) -> None:
    """Refuse (one sentence naming the tensor) safetensors weights in ``folder`` that hold
    a value that is not finite. Tensors are read one at a time, so memory holds the
    largest one only; files already read whole in this process, unchanged since, are
    not read again (a command checks at admission and again where an engine opens)."""
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _FINITE:
            _check_file(path, spec)
            _FINITE.add(key)


_FINITE: set[tuple[str, int, int]] = set()
"""The safetensors files (path, modification time, size) found finite in this process."""


def _check_file(path: Path, spec: str) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - a safe_open handle is no mapping
            tensor = handle.get_tensor(name)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise KvreplayError(
                    f"Model {spec!r} has weights that are not finite (NaN or an "
                    f"infinity in {name} of {path.name}), so every logit it gives would "
                    "be NaN; use weights that hold numbers."
                )
