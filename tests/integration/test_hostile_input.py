"""Issue 24, runs and refusals: hostile input that collided row keys, ran a model on random
weights, wrote what the audit cannot read, was refused only after the manifest, hung, or
ended in a traceback. Each is now exit 2 and one sentence on stderr, and a run refused
before its first row leaves no manifest.json behind."""

from __future__ import annotations

import csv
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    QUICK,
    check,
    copy_model,
    invoke,
    items_with,
    jsonl,
    run_args,
    run_case,
    synthetic_ledger,
    write_ledger,
)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from kvreplay.backends.hf.loading import load_model
from kvreplay.core.errors import KvreplayError
from kvreplay.experiments.matrix.table import LAYER_DRIFT, MATCHED_TABLE
from kvreplay.ledger import csv_cell, render_csv
from kvreplay.render.document import Paragraph, Table, to_markdown

NESTED = "[" * 50_000 + "]" * 50_000  # under csv's field limit, far past json's recursion


def quick_args(tmp: Path, model: Path, *extra: object) -> tuple[list[str], Path]:
    args, out = run_args("matched", tmp, model)
    return [*args, *QUICK, *map(str, extra)], out


def refused_before_the_manifest(args: list[str], out: Path, expected: str) -> None:
    check(invoke(*args), expected, out)
    assert not (out / "manifest.json").exists()


# Class 1 (row keys) and the 1 MB id: ids are checked at load, naming the line.
ITEM_IDS: dict[str, tuple[str, str]] = {
    "prefix": ("prefix", "is the word that marks a prefix row"),
    "slash": ("b1/bf16", "holds '/'"),
    "control": ("a\u0007b", "holds a control character"),
    "newline": ("a\nb", "holds a control character"),
    "long": ("x" * 201, "is 201 characters long (at most 200)"),
    "megabyte": ("y" * 1_000_000, "is 1000000 characters long"),
}


@pytest.mark.parametrize("case", list(ITEM_IDS))
def test_item_ids_that_cannot_be_row_key_parts(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    item_id, expected = ITEM_IDS[case]
    line = json.dumps({"id": item_id, "prompt": "p", "answer": "1"})
    run_case(lambda t: (items_with(t, line), f"line 4: the id {item_id[:40]!r} {expected}"),
             tmp_path, tiny_dirs["qwen2"])  # fmt: skip


def test_an_item_named_prefix_no_longer_collides(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """``fixed-prefix/prefix/bf16`` was both item prefix's bf16 row and item bf16's prefix
    row, so one row was never run and the run still exited 0."""
    lines = [json.dumps({"id": i, "prompt": f"{i}?", "answer": "1"}) for i in ("bf16", "prefix")]
    out = tmp_path / "out"
    args = ["run", "fixed-prefix", "--model", tiny_dirs["qwen2"], "--items",
            jsonl(tmp_path / "items.jsonl", lines), "--plan", "short", "--dtypes", "bf16",
            "--out", out]  # fmt: skip
    refused_before_the_manifest(args, out, "line 2: the id 'prefix' is the word")


# Class 2: weights that do not fit the config are refused before the manifest, and by the
# loader itself (workers, audit).
def _drop_tensor(model: Path) -> None:
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def _wrong_shape(model: Path) -> None:
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def _layers(change: int) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config["num_hidden_layers"] += change
        kinds = config.get("layer_types")
        if kinds:
            config["layer_types"] = (kinds + kinds[-1:])[: config["num_hidden_layers"]]
        (model / "config.json").write_text(json.dumps(config))

    return edit


BROKEN_MODELS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "missing_tensor": ("qwen2", _drop_tensor, "lack 1 tensor(s) (model.layers.0.mlp.up_proj"),
    "more_layers_in_config": ("qwen2", _layers(1), "lack 12 tensor(s) (model.layers.3."),
    "fewer_layers_in_config": ("gemma3", _layers(-1), "config describes, 13 tensor(s)"),
    "wrong_shape": ("llama", _wrong_shape, "wrong shape 1 tensor(s) (model.norm.weight"),
}


@pytest.mark.parametrize("case", list(BROKEN_MODELS))
def test_weights_that_do_not_fit_the_config(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    arch, damage, expected = BROKEN_MODELS[case]
    model = copy_model(tiny_dirs[arch], tmp_path / "model")
    damage(model)
    args, out = quick_args(tmp_path, model)
    refused_before_the_manifest(args, out, expected)
    with pytest.raises(KvreplayError, match="the weights do not match config.json"):
        load_model(str(model), "fp32")


def test_tied_weights_are_not_missing(tiny_dirs: dict[str, Path]) -> None:
    """Gemma3 ties lm_head to the embeddings and saves no lm_head: that is not a gap."""
    assert "lm_head.weight" not in load_file(tiny_dirs["gemma3"] / "model.safetensors")
    assert load_model(str(tiny_dirs["gemma3"]), "fp32").num_layers == 3


# Class 3: a number the audit's strict reader could not read back.
@pytest.mark.parametrize("number", ["1e400", "-1e400"])
def test_a_number_too_large_for_a_float(
    number: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    line = '{"id": "m", "prompt": "p", "answer": "1", "meta": {"x": ' + number + "}}"
    run_case(lambda t: (items_with(t, line), "line 4: a number is too large for a float"),
             tmp_path, tiny_dirs["qwen2"])  # fmt: skip


# Class 4: refused before the manifest, not after it.
def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


BEFORE_THE_MANIFEST: dict[str, Callable[[], tuple[list[object], str]]] = {
    "unknown_attn": lambda: (["--attn", "bogus"], "--attn bogus is not an attention"),
    "attn_not_installed": lambda: (
        ["--attn", "flash_attention_2"], "--attn flash_attention_2 cannot be used here"
    ),
    "ray_address_silent": lambda: (
        ["--engine", "ray", "--ray-address", f"127.0.0.1:{_closed_port()}"],
        "Nothing answers at the Ray address 127.0.0.1:",
    ),
    "ray_address_malformed": lambda: (
        ["--engine", "ray", "--ray-address", "nowhere"], "--ray-address 'nowhere' is not"
    ),
    "ray_gpus_on_cpu": lambda: (
        ["--engine", "ray", "--gpus-per-worker", "1"], "--device cpu with --gpus-per-worker 1"
    ),
    "ray_option_on_local": lambda: (
        ["--ray-address", "127.0.0.1:1"], "apply only to --engine ray"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BEFORE_THE_MANIFEST))
def test_refused_before_the_manifest_and_the_folder_stays_reusable(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    extra, expected = BEFORE_THE_MANIFEST[case]()
    if case == "attn_not_installed" and torch.cuda.is_available():
        pytest.skip("flash-attn may be installed where CUDA is")
    args, out = quick_args(tmp_path, tiny_dirs["qwen2"], *extra)
    refused_before_the_manifest(args, out, expected)


# Class 5: tracebacks, hangs and wrong exit codes.
OPTIONS: dict[str, tuple[list[object], str]] = {
    "threads_past_a_c_int": (["--threads", 2**31 + 1], "'--threads': 2147483649 is not in"),
    "workers_a_billion": (["--workers", 10**9], "'--workers': 1000000000 is not in"),
    "empty_out": (["--out", ""], "'--out': is empty"),
    "name_too_long": (["--out", "x" * 300], "a name in it is longer than the file system's"),
    "items_name_too_long": (["--items", "y" * 300 + ".jsonl"], "The item file yyy"),
    "model_name_too_long": (["--model", "z" * 300], "The model path zzz"),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_options_beyond_what_the_system_takes(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where an empty --out used to write the run
    extra, expected = OPTIONS[case]
    args, out = quick_args(tmp_path, tiny_dirs["qwen2"])
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    refused_before_the_manifest(args, out, expected)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("demo", "--workers", 10**9),
        ("demo", "--out", ""),
        ("audit", "x" * 300),
        ("audit", ".", "--threads", 2**31 + 1),
        ("analyze", "x" * 300),
        ("report", "."),
        ("report", ".", "--out-dir", ""),
        ("env", ""),
    ],
)
def test_other_commands_refuse_in_one_sentence(
    args: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    check(invoke(*args), "", tmp_path)
    assert not list(tmp_path.iterdir())


def test_resample_samples_past_the_limit(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    args, out = run_args("resample", tmp_path, tiny_dirs["qwen2"])
    args += [*QUICK, "--samples", str(10**12)]
    refused_before_the_manifest(
        args, out, "'--samples': 1000000000000 is not in the range 1<=x<=10000"
    )


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"GGUF", "is damaged or truncated"),
        (b"GGUF\x03\x00\x00\x00" + bytes(16), "is damaged or truncated"),
    ],
)
def test_a_gguf_file_that_is_only_its_header(content: bytes, expected: str, tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(content)
    args, out = quick_args(tmp_path, model)
    refused_before_the_manifest(args, out, f"The GGUF file {str(model)!r} {expected}")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_model_file_that_is_a_fifo(name: str, tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    """Reading a FIFO blocks until someone writes to it: refused without opening it."""
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    (model / name).unlink()
    os.mkfifo(model / name)
    args, out = quick_args(tmp_path, model)
    refused_before_the_manifest(args, out, f"holds {name}, which is not a regular file")


def test_a_plan_file_that_is_a_fifo(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    os.mkfifo(tmp_path / "plan.json")
    args, out = quick_args(tmp_path, tiny_dirs["qwen2"], "--plan", tmp_path / "plan.json")
    refused_before_the_manifest(args, out, "plan.json (not a regular file)")


def test_a_tokenizer_beyond_the_model_vocabulary(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens([f"<extra{i}>" for i in range(100)])
    tokenizer.save_pretrained(model)
    args, out = quick_args(tmp_path, model)
    refused_before_the_manifest(args, out, "has token ids up to 359, outside the model's vocab")


def _first_run(tmp: Path, model: Path, *extra: object) -> tuple[list[str], Path]:
    args, out = quick_args(tmp, model, *extra)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return args, out


def test_a_manifest_scheme_of_the_wrong_type_on_resume(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, out = _first_run(tmp_path, tiny_dirs["qwen2"])
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["contract"]["scheme"] = "x"
    (out / "manifest.json").write_text(json.dumps(manifest))
    check(invoke(*args), "manifest.json: field contract.scheme is 'x', not a scheme", out / "x")


def test_rows_jsonl_that_is_a_folder(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    args, out = _first_run(tmp_path, tiny_dirs["qwen2"])
    (out / "rows.jsonl").unlink()
    (out / "rows.jsonl").mkdir()
    check(invoke(*args), "rows.jsonl is not a regular file", out / "x")


@pytest.mark.parametrize("started_with", [False, True])
def test_resume_keeps_the_snapshot_choice(
    started_with: bool, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """The manifest says whether rows hold snapshots; a resume may not change that."""
    first = ["--save-snapshots"] if started_with else []
    args, out = _first_run(tmp_path, tiny_dirs["qwen2"], *first)
    args = [a for a in args if a != "--save-snapshots"] + (
        [] if started_with else ["--save-snapshots"]
    )
    flag = "with" if started_with else "without"
    check(invoke(*args), f"was started {flag} --save-snapshots; resume it {flag}", out / "x")


# Deeply nested or non-UTF-8 JSON given to analyze and report.
def test_analyze_refuses_a_deeply_nested_csv_cell(tmp_path: Path) -> None:
    header, rows = synthetic_ledger(MATCHED_TABLE.file)
    header.append(LAYER_DRIFT)
    rows = [row | {LAYER_DRIFT: "[0.5]"} for row in rows]
    rows[0][LAYER_DRIFT] = NESTED
    write_ledger(tmp_path, MATCHED_TABLE.file, header, rows)
    check(invoke("analyze", tmp_path), f"field {LAYER_DRIFT}: the value is", tmp_path / "x")


@pytest.fixture
def analysed_run(tmp_path: Path, tiny_dirs: dict[str, Path]) -> Path:
    _, out = _first_run(tmp_path, tiny_dirs["qwen2"])
    assert invoke("analyze", out).exit_code == 0
    return out


@pytest.mark.parametrize(
    "file, content, expected",
    [
        ("claims.json", NESTED.encode(), "claims.json: it is not valid JSON (values are nested"),
        (
            "claims.json",
            b"\xff\xfe{}",
            "claims.json: it is not valid JSON (the bytes are not UTF-8",
        ),
        ("manifest.json", ('{"contract": ' + NESTED + "}").encode(), "not a kvreplay run"),
    ],
)
def test_report_and_analyze_refuse_deep_or_non_utf8_json(
    file: str, content: bytes, expected: str, analysed_run: Path
) -> None:
    (analysed_run / file).write_bytes(content)
    check(invoke("report", analysed_run), expected, analysed_run / "x")
    if file == "manifest.json":
        check(invoke("analyze", analysed_run), expected, analysed_run / "x")


# Class 7, low severity: formula injection in CSV cells, raw HTML in report.md.
def test_csv_cells_that_a_spreadsheet_would_run_get_a_quote() -> None:
    assert [csv_cell(c) for c in ("=1+1", "@SUM(A1)", "+x", "-x", "\tx", "\rx")] == [
        "'=1+1", "'@SUM(A1)", "'+x", "'-x", "'\tx", "'\rx"
    ]  # fmt: skip
    assert [csv_cell(c) for c in ("-0.5", "+3", "-12", "1e-5", "r0012", "", "[1, 2]")] == [
        "-0.5", "+3", "-12", "1e-5", "r0012", "", "[1, 2]"
    ]  # fmt: skip
    text = render_csv(["row_id", "delta"], [{"row_id": "=HYPERLINK(1)", "delta": "-0.5"}])
    assert list(csv.reader(text.splitlines())) == [["row_id", "delta"], ["'=HYPERLINK(1)", "-0.5"]]


def test_a_run_with_formula_ids_writes_quoted_cells_that_analyze_accepts(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    lines = [json.dumps({"id": i, "prompt": f"{i}?", "answer": "1"}) for i in ("=cmd", "@x")]
    out = tmp_path / "out"
    result = invoke(*["run", "matched", "--model", tiny_dirs["qwen2"], "--items",
                     jsonl(tmp_path / "items.jsonl", lines), "--plan", "short", "--out", out,
                     *QUICK[2:]])  # fmt: skip
    assert result.exit_code == 0, result.output
    with (out / "matched_live_prefill.csv").open(newline="") as handle:
        assert [row["row_id"] for row in csv.DictReader(handle)] == ["'=cmd", "'@x"]
    assert invoke("analyze", out, "-o", tmp_path / "claims.json").exit_code == 0


def test_report_markdown_never_holds_raw_html(tmp_path: Path) -> None:
    blocks = [
        Paragraph("plan <script>alert(1)</script>, steps with margin <= 0.5"),
        Table(("stage plan",), [("<img src=x onerror=alert(1)>",)]),
    ]
    markdown = to_markdown(blocks, tmp_path)
    assert "<script" not in markdown and "<img" not in markdown
    assert "&lt;script>alert(1)&lt;/script>" in markdown
    assert "margin <= 0.5" in markdown
