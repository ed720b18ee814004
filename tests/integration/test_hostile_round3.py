"""Issue 45: untrusted input, third round. Each family the issue names, reproduced through
the command line as a hostile server, a hostile run folder or a careless-but-honest user
would meet it, and each now ends as it must: one sentence on stderr and exit 2 before
anything is written (nothing half-written left looking complete), or an audit that names
the file and field at fault; and an honest sequence of commands always audits.

The families: a secret a server echoes back; code from a folder beside the run; "exact
pins" that are not ASCII; outputs onto inputs by other routes; tracebacks; an audit that
passes what it should name; vacuous runs that exit 0; an honest resume the audit failed;
items ``cut-refeed`` writes that no run accepts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import QUICK, assert_one_sentence, check, invoke, run_args
from loopback import Loopback, Reply, Sent, TinyVllm

SECRET = "sk-round3-0123456789abcdef"
KEY_ENV = "KVREPLAY_ROUND3_KEY"


# Family 1: a secret that comes back.
def _echoing(field: str, echo: Callable[[str], Any]) -> Callable[[Sent], Reply]:
    """A vLLM-dialect server whose answer puts ``echo(Authorization header)`` in ``field``
    (``version``, ``model`` or ``block_size``'s neighbour ``cache_dtype``)."""

    def route(sent: Sent) -> Reply:
        header = sent.headers.get("Authorization", "")
        said = echo(header)
        answers: dict[str, Any] = {
            "/version": {"version": said if field == "version" else "0.32.0"},
            "/v1/models": {"data": [{"id": said if field == "model" else "m",
                                     "max_model_len": 1024}]},
            "/server_info": {"vllm_config": {
                "cache_config": {"block_size": 16, "enable_prefix_caching": True,
                                 "cache_dtype": said if field == "setting" else "auto"},
                "model_config": {"dtype": "torch.float32"}}},
            "/v1/completions": {"choices": [{"token_ids": [1]}],
                                "usage": {"prompt_tokens_details": {"cached_tokens": 0}}},
            "/tokenize": {"tokens": [1]},
        }  # fmt: skip
        path = sent.path.split("?")[0]
        if path == "/reset_prefix_cache":
            return Reply(200)
        return Reply.json(answers.get(path, {"error": "no"}), 200 if path in answers else 404)

    return route


ECHOES: dict[str, Callable[[str], str]] = {
    "header": lambda header: header,
    "key_alone": lambda header: header.removeprefix("Bearer "),
    "upper_case": lambda header: header.upper(),
    "a_piece": lambda header: "build-" + header[7:21],
    "spaced": lambda header: " ".join(header.removeprefix("Bearer ")),
    "hex": lambda header: header.removeprefix("Bearer ").encode().hex()[:60],
}


@pytest.mark.parametrize("field", ["version", "model", "setting"])
@pytest.mark.parametrize("echo", list(ECHOES))
def test_a_server_that_echoes_the_key_is_refused_without_showing_it(
    field: str, echo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Loopback(_echoing(field, ECHOES[echo])) as server:
        result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "holds the API key (--api-key-env) or another secret")
    for shown in (SECRET, SECRET[3:15], SECRET.upper()[3:15]):
        assert shown not in result.output


def test_a_run_against_an_echoing_server_writes_nothing(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    server = TinyVllm(tiny_dirs["qwen2"])
    try:
        server.hostile("/version", lambda path, answer: {"version": f"0.1 ({SECRET})"}, -1)
        args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
        result = invoke(*args, "--backend", "http", "--url", server.url, "--dtypes", "fp32",
                        "--companions", "0", "--api-key-env", KEY_ENV)  # fmt: skip
    finally:
        server.close()
    check(result, "its version holds the API key", out)
    assert SECRET not in result.output
    assert not (out / "manifest.json").exists()


def test_another_credential_of_this_process_is_withheld_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No --api-key-env: a token this process holds (HF_TOKEN) echoed in the model id."""
    token = "hf_round3TOKENabcdefghij"
    monkeypatch.setenv("HF_TOKEN", token)
    with Loopback(_echoing("model", lambda header: f"org/{token}")) as server:
        result = invoke("probe", "--url", server.url)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "its data[0].id holds the API key")
    assert token not in result.output


def test_an_honest_server_with_a_key_is_not_refused(
    tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Loopback(_echoing("version", lambda header: "0.32.0")) as server:
        result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
    assert result.exit_code == 0, result.output


# Family 2: code from a folder beside the run.
def _shipped_venv(folder: Path, marker: Path) -> Path:
    """A ready-made virtual environment whose ``.pth`` and ``pip`` would touch ``marker``."""
    site = folder / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    (site / "evil.pth").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    (folder / "bin").mkdir()
    pip = folder / "bin" / "pip"
    pip.write_text(f"#!/bin/sh\ntouch {marker}\n")
    pip.chmod(0o755)
    return folder


@pytest.mark.parametrize("shape", ["venv", "empty_pyvenv", "symlink"])
def test_env_never_runs_a_folder_it_did_not_create(
    shape: str, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    venv = tmp_path / ".venv-run"
    if shape == "venv":
        _shipped_venv(venv, marker)
    elif shape == "empty_pyvenv":
        venv.mkdir()
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    else:
        os.symlink(_shipped_venv(tmp_path / "elsewhere", marker), venv)
    result = invoke("env", run, "--venv", venv.name)
    assert result.exit_code == 2, result.output
    expected = "is a symbolic link" if shape == "symlink" else "already holds files"
    assert_one_sentence(result.stderr, expected)
    assert "$ " not in result.output and not marker.exists()


# Family 3: "exact pins" that are not ASCII.
NOT_ASCII = {
    "full_width_digits": "\uff12.\uff10.\uff11",
    "arabic_indic_digits": "\u0662.\u0660",
    "devanagari_digits": "\u0968.\u0966",
    "kelvin_sign_local_label": "2.0+\u212a",
    "long_s_post_release": "2.0.po\u017ft1",
    "dotless_i_pre_release": "2.0b\u0131",
    "superscript_digit": "2.0\u00b2",
    "full_width_epoch": "\uff11!2.0",
}


@pytest.mark.parametrize("case", list(NOT_ASCII))
def test_a_pin_that_is_not_ascii_is_refused_by_env_and_failed_by_audit(
    case: str, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = json.loads((run / "manifest.json").read_text())
    data["environment"]["distributions"]["numpy"] = NOT_ASCII[case]
    (run / "manifest.json").write_text(json.dumps(data, indent=2))
    for args in (["env", run], ["env", run, "--venv", tmp_path / "v"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert_one_sentence(result.stderr, "which is not an exact pin of a package on the index")
        assert not (tmp_path / "v").exists()
    audited = invoke("audit", run, "--sample", 0)
    assert audited.exit_code == 1, audited.output
    assert "manifest.json: field environment is malformed" in audited.stdout


def test_an_ascii_pin_in_upper_case_is_still_a_pin(run: Path) -> None:
    data = json.loads((run / "manifest.json").read_text())
    data["environment"]["distributions"]["numpy"] = "2.0RC1"
    (run / "manifest.json").write_text(json.dumps(data, indent=2))
    assert invoke("env", run).exit_code == 0


# Family 5: tracebacks (the readers of a run folder).
def _audited(run: Path) -> Any:
    result = invoke("audit", run, "--sample", 0)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result


def _named(run: Path, *needles: str) -> None:
    result = _audited(run)
    assert result.exit_code == 1, result.output
    found = [line for line in result.stdout.splitlines() if all(n in line for n in needles)]
    assert found, (needles, result.stdout)


ROWS_NOT_A_FILE: dict[str, Callable[[Path], None]] = {
    "fifo": lambda path: os.mkfifo(path),
    "dev_zero": lambda path: os.symlink("/dev/zero", path),
    "folder": lambda path: path.mkdir(),
    "dangling_link": lambda path: os.symlink(path.parent / "nowhere", path),
}


@pytest.mark.parametrize("case", list(ROWS_NOT_A_FILE))
def test_rows_jsonl_that_is_not_a_file(case: str, run: Path) -> None:
    (run / "rows.jsonl").unlink()
    ROWS_NOT_A_FILE[case](run / "rows.jsonl")
    _named(run, "rows.jsonl")
    for command in ("analyze", "report"):
        result = invoke(command, run)
        assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
        if result.exit_code == 2:
            assert_one_sentence(result.stderr, "")


CSV = "matched_live_prefill.csv"
CSV_DAMAGE: dict[str, Callable[[Path], None]] = {
    "cr_only": lambda path: path.write_bytes(path.read_bytes().replace(b"\n", b"\r")),
    "crlf": lambda path: path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n")),
    "bom": lambda path: path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes()),
    "line_of_100_mb": lambda path: path.write_bytes(path.read_bytes() + b"x" * (100 << 20)),
    "field_of_200_kb": lambda path: path.write_bytes(path.read_bytes() + b"y" * (200 << 10)),
    "fifo": lambda path: (path.unlink(), os.mkfifo(path)),
    "dev_zero": lambda path: (path.unlink(), os.symlink("/dev/zero", path)),
    "a_folder": lambda path: (path.unlink(), path.mkdir()),
    "not_utf8": lambda path: path.write_bytes(path.read_bytes() + b"\xff\xfe"),
    "nul_bytes": lambda path: path.write_bytes(path.read_bytes().replace(b",", b"\0,", 3)),
}


@pytest.mark.parametrize("case", list(CSV_DAMAGE))
def test_a_damaged_csv_is_named_by_the_audit(case: str, run: Path) -> None:
    CSV_DAMAGE[case](run / CSV)
    _named(run, CSV)


def _set_config(run: Path, key: str, value: Any, entry: bool = False) -> None:
    """Set a field of matched's config (or entry) and recompute its hash, as a forger would."""
    from kvreplay.core.canonical import sha256_json

    data = json.loads((run / "manifest.json").read_text())
    block = data["experiments"]["matched"]
    (block if entry else block["config"])[key] = value
    block["config_sha256"] = sha256_json(block["config"])
    (run / "manifest.json").write_text(json.dumps(data, indent=2))


CONFIG_TYPES: dict[str, tuple[str, Any, str]] = {
    "item_ids_a_number": ("item_ids", 5, "config.item_ids"),
    "item_ids_a_string": ("item_ids", "t0", "config.item_ids"),
    "item_ids_null": ("item_ids", None, "config.item_ids"),
    "dtypes_a_string": ("dtypes", "bf16", "config.dtypes"),
    "dtypes_an_object": ("dtypes", {"bf16": 1}, "config.dtypes"),
    "schema_version_a_flag": ("schema_version", True, "config.schema_version"),
    "fragile_a_list": ("fragile", [1], "config.fragile"),
}


@pytest.mark.parametrize("case", list(CONFIG_TYPES))
def test_a_config_field_of_the_wrong_type_is_named_not_raised(case: str, run: Path) -> None:
    key, value, named = CONFIG_TYPES[case]
    _set_config(run, key, value)
    _named(run, "experiments.matched", named)


def test_a_row_whose_arms_is_a_string(run: Path) -> None:
    from forgery import read_rows, rechain

    rows = read_rows(run)
    rows[0]["data"]["arms"] = "x"
    rechain(run, rows, derive_csv=False)
    _named(run, rows[0]["key"], "does not read as a matched row")
    for command in ("analyze", "report"):
        result = invoke(command, run)
        assert result.exit_code == 2, result.output
        assert_one_sentence(result.stderr, CSV)


# Family 6: an audit that passes what it should name.
def test_an_unknown_key_in_an_experiment_entry_is_named(run: Path) -> None:
    _set_config(run, "verdict", "pass", entry=True)
    _named(run, "experiments.matched.verdict is not one a kvreplay run writes")


def test_a_verdict_added_to_a_config_with_its_hash_recomputed_is_named(run: Path) -> None:
    _set_config(run, "verdict", "pass")
    _named(run, "experiments.matched.config.verdict is not a field a run writes")


def test_an_engine_note_of_the_wrong_type_is_named(run: Path) -> None:
    _set_config(run, "engine", "local", entry=True)
    _named(run, "experiments.matched.engine is not an object")


def _duplicate(line: str, key: str, value: str) -> str:
    """A JSON object line with ``key`` named twice: a second value after the first."""
    at = line.index(f'"{key}":')
    return line[:at] + f'"{key}":{value},' + line[at:]


def test_a_row_that_names_a_key_twice_is_named(run: Path) -> None:
    lines = (run / "rows.jsonl").read_text().splitlines(keepends=True)
    lines[0] = _duplicate(lines[0], "worker", '"elsewhere"')
    (run / "rows.jsonl").write_text("".join(lines))
    _named(run, "line 1", "names the key 'worker' twice")


def test_an_item_that_names_a_key_twice_is_named(run: Path) -> None:
    lines = (run / "items.jsonl").read_text().splitlines(keepends=True)
    lines[0] = _duplicate(lines[0], "answer", '"999"')
    (run / "items.jsonl").write_text("".join(lines))
    _named(run, "items.jsonl", "names the key 'answer' twice")


def test_a_manifest_that_names_a_key_twice_is_refused(run: Path) -> None:
    text = (run / "manifest.json").read_text()
    (run / "manifest.json").write_text(text.replace('"format":', '"format": "x",\n  "format":', 1))
    result = _audited(run)
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, "is not a kvreplay run")


BYTES_ONLY: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "manifest_bom": ("manifest.json", lambda b: b"\xef\xbb\xbf" + b),
    "manifest_crlf": ("manifest.json", lambda b: b.replace(b"\n", b"\r\n")),
    "manifest_reindented": ("manifest.json", lambda b: json.dumps(json.loads(b)).encode()),
    "manifest_final_newline": ("manifest.json", lambda b: b + b"\n"),
    "items_bom": ("items.jsonl", lambda b: b"\xef\xbb\xbf" + b),
    "items_crlf": ("items.jsonl", lambda b: b.replace(b"\n", b"\r\n")),
    "items_blank_line": ("items.jsonl", lambda b: b + b"\n"),
    "items_spaced": ("items.jsonl", lambda b: b.replace(b'": "', b'":  "')),
    "rows_bom": ("rows.jsonl", lambda b: b"\xef\xbb\xbf" + b),
    "rows_crlf": ("rows.jsonl", lambda b: b.replace(b"\n", b"\r\n")),
    "rows_spaced": ("rows.jsonl", lambda b: b.replace(b'":', b'": ')),
    "csv_bom": (CSV, lambda b: b"\xef\xbb\xbf" + b),
}


@pytest.mark.parametrize("case", list(BYTES_ONLY))
def test_a_byte_only_change_is_named(case: str, run: Path) -> None:
    name, change = BYTES_ONLY[case]
    (run / name).write_bytes(change((run / name).read_bytes()))
    _named(run, name.split(".")[0])


# Family 4: outputs onto inputs, by other routes.
def _check_args(tmp: Path, model: Path, *extra: object) -> tuple[list[object], Path]:
    args, out = run_args("matched", tmp, model)
    items = args[args.index("--items") + 1]
    return ["check", "--model", model, "--items", items, "--plan", "short", "--dtypes",
            "fp32", "--n", 1, "--out", out, *extra], out  # fmt: skip


@pytest.fixture
def checked(tmp_path: Path, tiny_dirs: dict[str, Path]) -> tuple[list[object], Path]:
    """A check run once (its folder then exists), and its arguments to run it again."""
    args, out = _check_args(tmp_path, tiny_dirs["qwen2"])
    assert invoke(*args).exit_code in (0, 1)
    return args, out


def _refused_untouched(args: list[object], expected: str, *kept: Path) -> None:
    before = {path: path.read_bytes() for path in kept}
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, expected)
    assert {path: path.read_bytes() for path in kept} == before


def test_json_onto_a_hard_link_of_the_rows(checked: tuple, tmp_path: Path) -> None:
    args, out = checked
    os.link(out / "rows.jsonl", tmp_path / "verdict.json")
    _refused_untouched([*args, "--json", tmp_path / "verdict.json"],
                       "is another name of", out / "rows.jsonl")  # fmt: skip


def test_junit_onto_a_symlink_to_the_manifest(checked: tuple, tmp_path: Path) -> None:
    args, out = checked
    os.symlink(out / "manifest.json", tmp_path / "junit.xml")
    _refused_untouched([*args, "--junit", tmp_path / "junit.xml"],
                       "is another name of", out / "manifest.json")  # fmt: skip


def test_json_onto_the_checks_own_items(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    args, _ = _check_args(tmp_path, tiny_dirs["qwen2"])
    items = Path(str(args[args.index("--items") + 1]))
    _refused_untouched([*args, "--json", items], "is another name of", items)


def test_json_onto_the_models_config(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from helpers import copy_model

    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    args, out = _check_args(tmp_path, model)
    _refused_untouched([*args, "--json", model / "config.json"], "is another name of",
                       model / "config.json")  # fmt: skip
    _refused_untouched([*args, "--json", model / "verdict.json"], "lies inside")
    assert not (model / "verdict.json").exists() and not out.exists()


def test_an_existing_repro_folder_holding_links_is_refused_before_the_check(
    checked: tuple,
) -> None:
    """A repro pack's files are written by name, never through a link planted under one:
    refused before the check runs (issue 49: the output writer refuses links)."""
    args, out = checked
    repro = out.with_name(out.name + ".repro")
    repro.mkdir(exist_ok=True)
    for name, target in (("item.jsonl", "items.jsonl"), ("repro.json", "rows.jsonl")):
        (repro / name).unlink(missing_ok=True)
        os.symlink(out / target, repro / name)
    kept = {name: (out / name).read_bytes() for name in ("items.jsonl", "rows.jsonl")}
    result = invoke(*args, "--expect", "bitwise")
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "is another name of")
    assert {name: (out / name).read_bytes() for name in kept} == kept
    assert (repro / "item.jsonl").is_symlink() and (repro / "repro.json").is_symlink()


@pytest.mark.parametrize("flag", ["--json", "--junit", "--repro"])
@pytest.mark.parametrize("where", ["/proc/kvreplay-out", "/sys/kvreplay-out", "/dev/kvreplay-out"])
def test_a_kernel_folder_is_refused_before_any_work(
    flag: str, where: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, out = _check_args(tmp_path, tiny_dirs["qwen2"])
    result = invoke(*args, flag, where)
    check(result, f"lies in /{where.split('/')[1]}", out)
    assert not out.exists()


def test_analyze_onto_the_runs_rows(run: Path, tmp_path: Path) -> None:
    os.link(run / "rows.jsonl", tmp_path / "claims.json")
    for target in (run / "rows.jsonl", run / "manifest.json", tmp_path / "claims.json"):
        _refused_untouched(["analyze", run, "-o", target], "is another name of",
                           run / "rows.jsonl", run / "manifest.json")  # fmt: skip
    assert invoke("analyze", run).exit_code == 0  # the default, claims.json, is its own


def test_report_into_a_kernel_folder(run: Path) -> None:
    result = invoke("report", run, "--out-dir", "/proc/kvreplay-report")
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, "lies in /proc")


def test_report_never_writes_figures_through_a_symlink(run: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "figures")
    result = invoke("report", run)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "is a symbolic link")
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("planted", [".write-probe", "manifest.json.tmp", "items.jsonl.tmp"])
def test_a_planted_link_in_a_run_folder_is_never_written_through(
    planted: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.symlink(victim, out / planted)
    result = invoke(*args, *QUICK)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me\n"


def test_a_rows_jsonl_that_is_a_symlink_is_refused_on_resume(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    assert invoke(*args, *QUICK).exit_code == 0
    (out / "rows.jsonl").rename(tmp_path / "rows.jsonl")
    os.symlink(tmp_path / "rows.jsonl", out / "rows.jsonl")
    kept = (tmp_path / "rows.jsonl").read_bytes()
    result = invoke(*args, "--n", 2, "--dtypes", "fp32")
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "rows.jsonl is not a regular file")
    assert (tmp_path / "rows.jsonl").read_bytes() == kept


def test_cut_refeed_into_a_kernel_folder_is_refused_before_generating(
    tiny_dirs: dict[str, Path],
) -> None:
    result = invoke("items", "cut-refeed", "--model", tiny_dirs["qwen2"], "--sources", 1,
                    "--cuts", 2, "--tokens", 8, "--out", "/proc/kvreplay-items.jsonl")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "lies in /proc")


# Family 8: an honest run the audit called forged.
EXPECTATIONS: dict[str, list[list[str]]] = {
    "exact_then_bitwise": [[], ["--expect", "bitwise"]],
    "bitwise_then_exact": [["--expect", "bitwise"], []],
    "back_and_forth": [[], ["--expect", "bitwise"], [], ["--expect", "bitwise"]],
    "max_divergent": [
        ["--expect", "max-divergent", "--max-divergent", "0"],
        ["--expect", "bitwise"],
        ["--expect", "max-divergent", "--max-divergent", "5"],
    ],  # fmt: skip
}


@pytest.mark.parametrize("case", list(EXPECTATIONS))
def test_an_honest_users_sequence_always_audits(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """Run, resume, change the expectation, rerun, report, audit: every step either is
    refused up front or leaves a folder the audit passes."""
    args, out = _check_args(tmp_path, tiny_dirs["drift_qwen2"])
    args[args.index("--n") + 1] = 3
    for expect in [*EXPECTATIONS[case], EXPECTATIONS[case][-1]]:  # the last one resumed
        result = invoke(*args, *expect)
        assert result.exit_code in (0, 1), result.output
        audited = invoke("audit", out)
        assert audited.exit_code == 0, (expect, audited.output)
    assert invoke("analyze", out).exit_code == 0
    assert invoke("report", out).exit_code == 0
    audited = invoke("audit", out)
    assert audited.exit_code == 0, audited.output


# Family 7: runs that are vacuous, or read another model's run, and exit 0.
@pytest.mark.parametrize("experiment", ["fixed-prefix", "bridge", "transplant", "localize"])
def test_from_a_run_of_another_model_is_refused_by_every_experiment(
    experiment: str, run: Path, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    out = tmp_path / "other"
    source = json.loads((run / "manifest.json").read_text())["contract"]["items"]["source"]
    result = invoke("run", experiment, "--model", tiny_dirs["llama"], "--items", source,
                    "--plan", "short", "--dtypes", "bf16", "--from", run, "--out", out)  # fmt: skip
    check(result, "(--from) ran on the model", out)
    assert not out.exists()


def test_from_a_run_that_records_no_model_is_refused(
    run: Path, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    from forgery import read_rows, rechain

    from kvreplay.core.canonical import sha256_json

    data = json.loads((run / "manifest.json").read_text())
    del data["contract"]["run"]["model_digest"]
    data["contract_sha256"] = sha256_json(data["contract"])
    (run / "manifest.json").write_text(json.dumps(data, indent=2))
    rechain(run, read_rows(run), data["contract_sha256"])
    out = tmp_path / "other"
    result = invoke("run", "bridge", "--model", tiny_dirs["qwen2"], "--items",
                    data["contract"]["items"]["source"], "--plan", "short", "--dtypes", "bf16",
                    "--from", run, "--out", out)  # fmt: skip
    check(result, "does not record the model it ran on", out)


@pytest.fixture(scope="module")
def tiny_server(tiny_dirs: dict[str, Path]) -> Iterator[TinyVllm]:
    server = TinyVllm(tiny_dirs["qwen2"])
    yield server
    server.close()


def _block(size: int) -> Callable[[str, dict], dict]:
    def tamper(path: str, answer: dict) -> dict:
        answer["vllm_config"]["cache_config"]["block_size"] = size
        return answer

    return tamper


@pytest.mark.parametrize("size", [10**9, 2**31, 4096])
@pytest.mark.parametrize("command", ["run", "check"])
def test_a_block_longer_than_any_prefix_is_refused_as_vacuous(
    size: int, command: str, tiny_server: TinyVllm, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    tiny_server.tamper, tiny_server.completions = None, 0
    tiny_server.hostile("/server_info", _block(size), -1)
    served = ["--backend", "http", "--url", tiny_server.url, "--companions", "0"]
    if command == "run":
        args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
        args += [*served, "--dtypes", "fp32"]
    else:
        args, out = _check_args(tmp_path, tiny_dirs["qwen2"], *served)
    try:
        result = invoke(*args)
    finally:
        tiny_server.tamper = None
    check(result, "every hit would read no cached token", out)
    assert not (out / "manifest.json").exists()


def test_a_block_the_prefixes_fill_is_not_vacuous(
    tiny_server: TinyVllm, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    tiny_server.tamper, tiny_server.completions = None, 0
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    result = invoke(*args, "--backend", "http", "--url", tiny_server.url, "--dtypes", "fp32",
                    "--companions", "0", "--n", 1)  # fmt: skip
    assert result.exit_code == 0, result.output


# Family 5, continued: a model whose numbers are not finite.
def _set_weights(model: Path, change: Callable[[str, Any], Any]) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    save_file({name: change(name, t) for name, t in weights.items()},
              model / "model.safetensors", metadata={"format": "pt"})  # fmt: skip


WEIGHTS: dict[str, tuple[Callable[[str, Any], Any], str]] = {
    "all_nan": (lambda name, t: t * float("nan"), "has weights that are not finite"),
    "one_inf": (
        lambda name, t: t.index_fill(0, t.new_zeros(1, dtype=int), float("inf"))
        if name == "model.norm.weight" else t,
        "(NaN or an infinity in model.norm.weight",
    ),
    "overflowing_head": (
        lambda name, t: t.clamp(min=0) * 3e38 + 3e38 if name == "lm_head.weight" else t,
        "holds a number that is not finite",
    ),
}  # fmt: skip


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_numbers_that_are_not_finite_end_in_one_sentence_and_leave_no_manifest(
    case: str, command: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    from helpers import copy_model

    change, expected = WEIGHTS[case]
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    _set_weights(model, change)
    if command == "run":
        args, out = run_args("matched", tmp_path, model)
        args += QUICK
    else:
        args, out = _check_args(tmp_path, model)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1].startswith("kvreplay: error: ")
    assert expected in result.stderr.splitlines()[-1]
    assert not (out / "manifest.json").exists() and not (out / "rows.jsonl").exists()


# Family 9: items cut-refeed writes that no run accepts.
REFEED_SOURCES: dict[str, tuple[dict[str, Any], list[object], str]] = {
    "id_outside_the_vocabulary": (
        {"id": "a", "prompt": [5, 10**6], "answer": "1"}, [], "outside the model's vocabulary"
    ),
    "id_beyond_64_bits": (
        {"id": "a", "prompt": [5, 2**70], "answer": "1"}, [], "outside the model's vocabulary"
    ),
    "id_of_64_digits": (
        {"id": "a", "prompt": [5, 10**63], "answer": "1"}, [], "outside the model's vocabulary"
    ),
    "source_id_of_198_characters": (
        {"id": "x" * 198, "prompt": "hello", "answer": "1"}, [], "characters long (at most 200)"
    ),
    "source_id_of_195_characters": (
        {"id": "y" * 195, "prompt": "hello", "answer": "1"}, [], "characters long (at most 200)"
    ),
    "past_the_context_window": (
        {"id": "a", "prompt": "hello", "answer": "1"}, ["--tokens", 4000],
        "would run past the model's context window of",
    ),
    "a_long_prompt_past_the_context": (
        {"id": "a", "prompt": [i % 300 for i in range(1000)], "answer": "1"}, ["--tokens", 100],
        "would run past the model's context window of",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFEED_SOURCES))
def test_cut_refeed_refuses_sources_whose_items_no_run_accepts(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    source, extra, expected = REFEED_SOURCES[case]
    items = tmp_path / "sources.jsonl"
    items.write_text(json.dumps(source) + "\n")
    out = tmp_path / "cut.jsonl"
    result = invoke("items", "cut-refeed", "--model", tiny_dirs["qwen2"], "--from", items,
                    "--sources", 1, "--cuts", 2, "--tokens", 8, *extra, "--out", out)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, expected)
    assert not out.exists()


def test_cut_refeed_items_are_items_a_run_accepts(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    items = tmp_path / "sources.jsonl"
    items.write_text(json.dumps({"id": "z" * 190, "prompt": "hello", "answer": "1"}) + "\n")
    out = tmp_path / "cut.jsonl"
    made = invoke("items", "cut-refeed", "--model", tiny_dirs["qwen2"], "--from", items,
                  "--sources", 1, "--cuts", 2, "--tokens", 8, "--out", out)  # fmt: skip
    assert made.exit_code == 0, made.output
    args, run = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    result = invoke(*args, "--items", out, "--dtypes", "fp32")
    assert result.exit_code == 0, result.output


# Family 5, continued: GGUF metadata that llama.cpp or transformers' conversion rejects.
GGUF_FIELDS: dict[str, tuple[str, int, str]] = {
    "heads_do_not_split_the_embedding": (
        "llama.attention.head_count",
        7,
        "gives an embedding of 576 for 7 attention heads",
    ),
    "embedding_not_split_by_heads": (
        "llama.embedding_length",
        577,
        "gives an embedding of 577 for 9 attention heads",
    ),
    "kv_heads_do_not_split_heads": (
        "llama.attention.head_count_kv",
        4,
        "gives 9 attention heads for 4 key/value heads",
    ),
    "bos_outside_the_tokens": ("tokenizer.ggml.bos_token_id", 60000, "bos_token_id 60000"),
    "eos_outside_the_tokens": ("tokenizer.ggml.eos_token_id", 2**32 - 1, "eos_token_id 4294967295"),
    "padding_outside_the_tokens": ("tokenizer.ggml.padding_token_id", 49152, "outside its 49152"),
    "no_attention_heads": ("llama.attention.head_count", 0, "gives 0 attention heads"),
}


@pytest.mark.slow  # a copy of the embedded SmolLM2 GGUF (90 MB) per case
@pytest.mark.parametrize("backend", ["hf", "llamacpp"])
@pytest.mark.parametrize("case", list(GGUF_FIELDS))
def test_gguf_metadata_the_runtime_rejects_is_refused_in_one_sentence(
    case: str, backend: str, tmp_path: Path
) -> None:
    import shutil

    from gguf import GGUFReader

    from kvreplay.backends.llamacpp import LlamaCppBackend
    from kvreplay.model.embedded import EMBEDDED

    if backend == "llamacpp" and not LlamaCppBackend().installed():
        pytest.skip("llama.cpp is not built here (make setup-llamacpp)")
    key, value, expected = GGUF_FIELDS[case]
    model = tmp_path / "model.gguf"
    shutil.copy(EMBEDDED["smollm2-135m"].part_paths()[0], model)
    fields = GGUFReader(str(model), "r+").fields
    fields[key].parts[fields[key].data[0]][0] = value  # in place: the file is mapped
    del fields
    out = tmp_path / "out"
    result = invoke("run", "matched", "--backend", backend, "--model", model, "--n", 1,
                    "--dtypes", "fp16" if backend == "llamacpp" else "fp32", "--plan", "short",
                    "--out", out)  # fmt: skip
    check(result, expected, out)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("length", [990, 1000, 1014])
def test_cut_refeed_items_leave_room_for_the_runs_plan(
    length: int, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """A prompt near the tiny model's 1,024-token window: every cut leaves the plan room,
    or the source is refused when none can (before any generation)."""
    items = tmp_path / "sources.jsonl"
    items.write_text(json.dumps({"id": "n", "prompt": [7] * length, "answer": "1"}) + "\n")
    out = tmp_path / "cut.jsonl"
    made = invoke("items", "cut-refeed", "--model", tiny_dirs["qwen2"], "--from", items,
                  "--sources", 1, "--cuts", 2, "--tokens", 8, "--plan", "short",
                  "--out", out)  # fmt: skip
    if made.exit_code == 2:
        assert_one_sentence(made.stderr, "so no cut of its generation leaves room")
        assert not out.exists()
        return
    assert made.exit_code == 0, made.output
    args, _ = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    result = invoke(*args, "--items", out, "--dtypes", "fp32")
    assert result.exit_code == 0, result.output


# The vllm backend (run in .venv-vllm): its block size and its weights, before the manifest.
@pytest.mark.vllm
@pytest.mark.parametrize("case", ["block_past_every_prefix", "nan_weights"])
def test_vllm_refuses_a_vacuous_block_and_weights_that_are_not_finite(
    case: str, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    from tiny import save_tiny

    model = save_tiny(tmp_path / "model", "served_qwen2")
    extra: list[object] = ["--block-size", 65536]  # the largest block: past every prefix
    expected = "every hit would read no cached token"
    if case == "nan_weights":
        _set_weights(model, WEIGHTS["all_nan"][0])
        extra, expected = [], "has weights that are not finite"
    args, out = run_args("matched", tmp_path, model)
    result = invoke(*args, "--backend", "vllm", "--n", 1, "--dtypes", "fp32", *extra)
    check(result, expected, out)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("engine", ["local", [], 7])
def test_an_engine_note_of_another_type_with_a_report_is_named_not_raised(
    engine: Any, run: Path
) -> None:
    assert invoke("analyze", run).exit_code == 0 and invoke("report", run).exit_code == 0
    _set_config(run, "engine", engine, entry=True)
    _named(run, "experiments.matched.engine is not an object")
    result = invoke("report", run)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "it is not a kvreplay run manifest")


@pytest.mark.parametrize("name", ["manifest.json", "claims.json"])
def test_a_json_file_too_large_for_what_it_holds_is_not_read_whole(name: str, run: Path) -> None:
    assert invoke("analyze", run).exit_code == 0
    with (run / name).open("ab") as handle:
        handle.truncate(65 * 2**20)  # a sparse 65 MiB: NULs past the JSON
    for command in (["audit", run, "--sample", 0], ["report", run]):
        result = invoke(*command)
        assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
        if result.exit_code == 2:
            assert_one_sentence(result.stderr, "")
