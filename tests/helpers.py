"""Plans, prompts and small helpers shared by the core-engine tests."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from kvreplay import (
    BoundaryState,
    LoadedModel,
    Prefix,
    StagePlan,
    build,
    clone,
    continue_from,
    encode_prompt,
    live,
)
from kvreplay.cli import main
from kvreplay.stages import Stage

ARCHS = ("qwen2", "llama", "gemma3")
DTYPES = ("bf16", "fp32")

# Long enough on the tiny models for bf16 prefill to drift from live (24 decoded tokens
# in the prefix) and for that drift to flip a suffix token on some prompt of each arch.
PLAN = StagePlan(
    name="test",
    stages=(
        Stage("think", max_new_tokens=24),
        Stage("trace", max_new_tokens=48),
        Stage("answer", max_new_tokens=4, opener="\nA:"),
    ),
)
# A short plan for tests that only need some boundary state.
SHORT = StagePlan(
    name="test-short",
    stages=(
        Stage("think", max_new_tokens=10),
        Stage("trace", max_new_tokens=8),
        Stage("answer", max_new_tokens=3, opener="\nA:"),
    ),
)
DEFAULT_THREADS = torch.get_num_threads()  # read at collection, before conftest sets 1
INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
PROMPTS = (
    "Compute 3 + 4 * 5 step by step.",
    "A shop has 17 apples. It sells 5 apples. How many are left?",
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 3,
)


_WORDS = "apple river seven blue window market quiet stone number garden".split()
# Prompts of 12 to 44 tokens: on drift_qwen2 (tests/tiny.py) the short ones stay exact
# and most long ones diverge, on every kernel family.
PROMPT_POOL = tuple(
    f"Item {i}: " + " ".join(_WORDS[(i * 7 + j * 3) % 10] for j in range(i % 6)) + "?"
    for i in range(16)
)


@dataclass(frozen=True)
class Divergence:
    """Prompts of a bounded pool on which prefill's suffix differs from replay's (with
    equal boundary argmaxes, as a transplant panel needs) and does not differ."""

    divergent: tuple[str, ...]
    exact: tuple[str, ...]


def find_divergence(
    lm: LoadedModel, plan: StagePlan, want: int = 1, pool: tuple[str, ...] = PROMPT_POOL
) -> Divergence:
    """Search ``pool`` in order; fail with a clear message if it holds too few cases."""
    divergent: list[str] = []
    exact: list[str] = []
    for prompt in pool:
        _, prefix = reach(lm, plan, prompt)
        replay, prefill = build(lm, prefix, "replay"), build(lm, prefix, "prefill")
        differs = (
            continue_from(lm, clone(replay), plan).token_ids
            != continue_from(lm, clone(prefill), plan).token_ids
        )
        if differs and replay.argmax() == prefill.argmax():
            divergent.append(prompt)
        elif not differs:
            exact.append(prompt)
        if len(divergent) >= want and exact:
            return Divergence(tuple(divergent), tuple(exact))
    pytest.fail(
        f"{lm.spec}: {len(divergent)} divergent and {len(exact)} exact prompts in the "
        f"{len(pool)}-prompt pool under {torch.backends.cpu.get_cpu_capability()} kernels; "
        f"the test needs {want} and 1"
    )


def perturbed(state: BoundaryState, seed: int = 0) -> BoundaryState:
    """A copy of ``state`` whose K/V differ from it by seeded noise (logits kept): a donor
    that differs by construction, whatever the CPU's rounding."""
    copy = clone(state)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():  # the cache holds inference tensors
        for layer in copy.cache.layers:
            for tensor in (layer.keys, layer.values):
                noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
                tensor.add_(noise * 0.1)
    copy.construction = "perturbed"
    return copy


def invoke(*args: object) -> Result:
    """``kvreplay ARGS`` through click's runner, in this process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def reach(
    lm: LoadedModel, plan: StagePlan = SHORT, prompt: str = PROMPTS[0]
) -> tuple[BoundaryState, Prefix]:
    """The live boundary state and prefix of ``prompt`` under ``plan``."""
    return live(lm, encode_prompt(lm.tokenizer, prompt), plan)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (so -0.0 != 0.0 and NaN == NaN bitwise)."""
    return tensor.detach().contiguous().view(INT_OF_SIZE[tensor.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def cache_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Every K and V tensor bit-equal and every layer's length equal."""
    return a.layer_lengths() == b.layer_lengths() and all(
        bit_equal(x, y)
        for pa, pb in zip(a.layer_tensors(), b.layer_tensors(), strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def state_equal(a: BoundaryState, b: BoundaryState) -> bool:
    """Same prefix, bit-equal cache and bit-equal boundary logits."""
    assert a.logits is not None and b.logits is not None
    return a.token_ids == b.token_ids and cache_equal(a, b) and bit_equal(a.logits, b.logits)


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the session runs (conftest); said explicitly where it
    matters, e.g. a Ray actor reserves one of the machine's CPUs per driver thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def default_threads() -> Iterator[None]:
    """Run with torch's default intra-op thread count, as a user's run would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_items(path: Path, prompts: Sequence[str], prefix: str, answer: str) -> Path:
    """An item file: one item per prompt, ids ``{prefix}{index}``, the same answer."""
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{i}", "prompt": p, "answer": answer}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError("the server did not come up")
