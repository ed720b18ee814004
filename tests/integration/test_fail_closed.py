"""Issue 11: bad input that used to end in a traceback, or was wrongly accepted or
refused. Each refusal is exit 2, one sentence on stderr, no traceback, and nothing in
``--out`` that looks complete; a refusal before the first row leaves the folder reusable.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import QUICK, check, copy_model, invoke, items_with, jsonl, run_args, run_case
from tiny import build

from kvreplay.backends.hf.loading import load_model
from kvreplay.core.errors import KvreplayError


def plan_with(tmp: Path, **stage: object) -> list[str]:
    think = {"name": "think", "max_new_tokens": 4, **stage}
    boundary = stage.pop("boundary", 0) if "boundary" in stage else 0
    think.pop("boundary", None)
    plan = {"boundary": boundary, "stages": [think, {"name": "answer", "max_new_tokens": 2}]}
    path = tmp / "plan.json"
    path.write_text(json.dumps(plan))
    return ["--plan", str(path)]


# name -> (extra arguments, words the one sentence must hold)
CASES: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    "lone_surrogate": lambda t: (
        items_with(t, '{"id": "s", "prompt": "\\ud800", "answer": "1"}'),
        "line 4: a string holds a lone surrogate",
    ),
    "huge_integer_answer": lambda t: (
        items_with(t, '{"id": "h", "prompt": "p", "answer": ' + "7" * 5000 + "}"),
        "line 4: an integer has 5000 digits",
    ),
    "deeply_nested_meta": lambda t: (
        items_with(t, '{"id": "d", "prompt": "p", "answer": "1", "meta": ' + "[" * 500
                   + "]" * 500 + "}"),
        "line 4: values are nested deeper than 64 levels",
    ),
    "nan_in_meta": lambda t: (
        items_with(t, '{"id": "n", "prompt": "p", "answer": "1", "meta": {"x": NaN}}'),
        "line 4: NaN is not a JSON number",
    ),
    "unknown_chat_role": lambda t: (
        items_with(t, json.dumps({"id": "r", "prompt": [{"role": "wizard", "content": "hi"}],
                                  "answer": "1"})),
        "line 4: unknown chat role 'wizard'",
    ),
    "device_banana": lambda t: (["--device", "banana"], "Unknown device 'banana'"),
    "temperature_nan": lambda t: (["--temperature", "nan"], "--temperature must lie between"),
    "workers_zero": lambda t: (["--workers", "0"], "--workers"),
    "dtypes_twice": lambda t: (["--dtypes", "bf16,bf16"], "--dtypes names bf16 twice"),
    "boundary_half": lambda t: (plan_with(t, boundary=0.5), "'boundary' must be a stage index"),
    "boundary_true": lambda t: (plan_with(t, boundary=True), "'boundary' must be a stage index"),
    "opener_integer": lambda t: (plan_with(t, opener=7), "'opener' must be a string"),
    "stop_a_string": lambda t: (plan_with(t, stop="abc"), "'stop' must be a list of strings"),
    "max_new_tokens_zero": lambda t: (plan_with(t, max_new_tokens=0), "'max_new_tokens'"),
    "max_new_tokens_negative": lambda t: (plan_with(t, max_new_tokens=-5), "'max_new_tokens'"),
    "max_new_tokens_fraction": lambda t: (plan_with(t, max_new_tokens=2.5), "'max_new_tokens'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_sentence(case: str, tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    run_case(CASES[case], tmp_path, tiny_dirs["qwen2"])


def test_cuda_without_cuda_is_refused_before_any_write(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run_case(lambda t: (["--device", "cuda"], "CUDA is not available"), tmp_path,
             tiny_dirs["qwen2"])  # fmt: skip


def test_token_id_above_the_vocabulary(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    trace = {"id": "t", "prefix_token_ids": [1, 2, 99999], "prompt_token_count": 1, "answer": "1"}
    items = jsonl(tmp_path / "traces.jsonl", [json.dumps(trace)])
    out = tmp_path / "out"
    args = ["run", "fixed-prefix", "--model", tiny_dirs["qwen2"], "--items", items,
            "--plan", "short", "--out", out]  # fmt: skip
    check(invoke(*args), "Item t has token id 99999 in prefix_token_ids, outside", out)
    assert not (out / "manifest.json").exists()


def test_u2028_inside_a_string_is_accepted(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    line = json.dumps({"id": "u", "prompt": "a\u2028b", "answer": "1"}, ensure_ascii=False)
    assert "\u2028" in line
    items = jsonl(tmp_path / "items.jsonl", [line])
    out = tmp_path / "out"
    result = invoke(*["run", "matched", "--model", tiny_dirs["qwen2"], "--items", items,
                     "--plan", "short", "--out", out, *QUICK])  # fmt: skip
    assert result.exit_code == 0, result.output
    frozen = json.loads((out / "items.jsonl").read_text(encoding="utf-8"))
    assert frozen["prompt"] == "a\u2028b"


def test_ids_that_differ_in_unsafe_characters_keep_their_own_snapshots(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    lines = [json.dumps({"id": i, "prompt": f"{i}?", "answer": "1"}) for i in ("x:y", "x_y")]
    out = tmp_path / "out"
    result = invoke(*["run", "matched", "--model", tiny_dirs["qwen2"], "--items",
                     jsonl(tmp_path / "items.jsonl", lines), "--plan", "short", "--out", out,
                     "--dtypes", "fp32", "--save-snapshots"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(list((out / "snapshots").glob("*.safetensors"))) == 8  # 2 rows x 4 arms
    audited = invoke(*["audit", out])
    assert audited.exit_code == 0, audited.output


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_weights_are_refused_before_the_manifest_and_the_folder_stays_reusable(
    damage: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2] if damage == "truncated" else b"garbage" * 99)
    args, out = run_args("matched", tmp_path, model)
    check(invoke(*args + QUICK), "The weights file model.safetensors of model", out)
    assert not (out / "manifest.json").exists()
    weights.write_bytes(good)
    result = invoke(*args + QUICK)
    assert result.exit_code == 0, result.output


def test_damage_after_the_manifest_leaves_the_folder_reusable(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """A manifest without rows commits to nothing: a corrected rerun replaces it."""
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    out.mkdir()
    (out / "manifest.json").write_text(
        json.dumps(
            {"format": "kvreplay-run-v1", "contract": {}, "contract_sha256": "", "experiments": {}}
        )
    )
    (out / "items.jsonl").write_text("stale\n")  # fmt: skip
    result = invoke(*args + QUICK)
    assert result.exit_code == 0, result.output
    assert invoke(*["audit", out]).exit_code == 0


def test_folder_without_a_tokenizer(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    run_case(lambda t: ([], "has no tokenizer files"), tmp_path, model)


def test_trailing_slash_resumes_the_same_run(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    assert invoke(*args + QUICK).exit_code == 0
    args[args.index("--model") + 1] = str(tiny_dirs["qwen2"]) + "/"
    result = invoke(*args + QUICK)
    assert result.exit_code == 0, result.output


def test_pickle_weights_are_refused_without_reaching_torch_load(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "pickled"
    tiny = build("qwen2")
    tiny.config.save_pretrained(model)
    torch.save(tiny.state_dict(), model / "pytorch_model.bin")  # what transformers once wrote
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dirs["qwen2"] / name, model / name)
    assert (model / "pytorch_model.bin").is_file()
    assert not list(model.glob("*.safetensors"))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(KvreplayError, match="safe_serialization=True"):
        load_model(str(model), "fp32")
    run_case(lambda t: ([], "has only pickle weights (pytorch_model.bin)"), tmp_path, model)


REMOTE_CONFIG = """
from transformers import Qwen2Config


class TinyXConfig(Qwen2Config):
    model_type = "tinyx"
"""
REMOTE_MODEL = """
from transformers import Qwen2ForCausalLM

from .configuration_tinyx import TinyXConfig


class TinyXForCausalLM(Qwen2ForCausalLM):
    config_class = TinyXConfig
"""


def test_trust_remote_code_is_passed_on_and_off_by_default(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "remote")
    (model / "configuration_tinyx.py").write_text(REMOTE_CONFIG)
    (model / "modeling_tinyx.py").write_text(REMOTE_MODEL)
    config = json.loads((model / "config.json").read_text())
    config |= {
        "model_type": "tinyx",
        "architectures": ["TinyXForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_tinyx.TinyXConfig",
            "AutoModelForCausalLM": "modeling_tinyx.TinyXForCausalLM",
        },
    }
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "off").mkdir()
    run_case(lambda t: ([], "pass --trust-remote-code"), tmp_path / "off", model)
    args, out = run_args("matched", tmp_path, model)
    result = invoke(*[*args, *QUICK, "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    assert (
        json.loads((out / "manifest.json").read_text())["contract"]["model_info"]["model_type"]
        == "tinyx"
    )


def test_full_disk_is_one_sentence_and_leaves_no_temporary_files(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while freezing items.jsonl (after the manifest): one sentence, no *.tmp or
    probe left behind, and the same command then runs in the same folder."""
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(".items.jsonl."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", full)
        check(invoke(*args + QUICK), "No space left on device", out)
    assert not [*out.glob("*.tmp"), *out.glob(".*.tmp"), *out.glob(".write-probe")]
    assert not (out / "items.jsonl").exists()
    result = invoke(*args + QUICK)
    assert result.exit_code == 0, result.output


def test_analyze_refuses_a_csv_that_is_not_utf8(tmp_path: Path) -> None:
    folder = tmp_path / "ledgers"
    folder.mkdir()
    (folder / "matched_live_prefill.csv").write_bytes(b"row_id,precision\n\xff\xfe,bf16\n")
    result = invoke(*["analyze", folder])
    check(result, "matched_live_prefill.csv: the file is not UTF-8 text", tmp_path / "none")


def test_analyze_refuses_a_run_csv_cut_at_a_row_boundary(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    lines = [json.dumps({"id": f"c{i}", "prompt": f"{i}+1?", "answer": "1"}) for i in range(2)]
    out = tmp_path / "out"
    result = invoke(*["run", "matched", "--model", tiny_dirs["qwen2"], "--items",
                     jsonl(tmp_path / "items.jsonl", lines), "--plan", "short", "--out", out,
                     "--dtypes", "fp32"])  # fmt: skip
    assert result.exit_code == 0, result.output
    csv = out / "matched_live_prefill.csv"
    csv.write_text("".join(csv.read_text().splitlines(keepends=True)[:-1]))
    refused = invoke(*["analyze", out, "-o", tmp_path / "claims.json"])
    assert refused.exit_code == 2, refused.output
    assert "do not match its rows.jsonl" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "Traceback" not in refused.output
    assert not (tmp_path / "claims.json").exists()


@pytest.mark.parametrize("edit", [{"experiments": []}, {"contract_sha256": 5}, {"contract": "x"}])
def test_audit_refuses_a_manifest_with_wrong_types(edit: dict, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    manifest = {"format": "kvreplay-run-v1", "contract": {}, "contract_sha256": "",
                "experiments": {}} | edit  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    check(invoke(*["audit", folder]), "manifest.json: field", tmp_path / "none")


def test_audit_sample_must_not_be_negative(tmp_path: Path) -> None:
    check(invoke(*["audit", tmp_path, "--sample", "-1"]), "--sample", tmp_path / "none")
