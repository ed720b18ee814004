"""Bad input (issues 2, 3): refused before any model work with one sentence on stderr and
exit code 2, no traceback, and nothing in ``--out`` that looks like a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import (
    assert_nothing_complete,
    assert_one_sentence,
    check,
    good_lines,
    jsonl,
    run_args,
)

from kvreplay.cli import main


def malformed(tmp: Path) -> tuple[list[str], str]:
    lines = good_lines()
    lines[1] = '{"id": "b2", "prompt": "Compute 4*5.", "answer": '
    return ["--items", str(jsonl(tmp / "bad.jsonl", lines))], "line 2: malformed JSON"


def missing_field(tmp: Path) -> tuple[list[str], str]:
    lines = good_lines()
    lines[2] = json.dumps({"id": "b3", "prompt": "9-4?"})
    return ["--items", str(jsonl(tmp / "bad.jsonl", lines))], "line 3: missing field 'answer'"


def missing_prompt(tmp: Path) -> tuple[list[str], str]:
    lines = good_lines()
    lines[0] = json.dumps({"id": "b1", "answer": "5"})
    return ["--items", str(jsonl(tmp / "bad.jsonl", lines))], "line 1: missing field 'prompt'"


def duplicate_ids(tmp: Path) -> tuple[list[str], str]:
    lines = [*good_lines(), json.dumps({"id": "b2", "prompt": "again", "answer": "1"})]
    return ["--items", str(jsonl(tmp / "bad.jsonl", lines))], "line 4: duplicate id 'b2'"


def n_too_large(tmp: Path) -> tuple[list[str], str]:
    items = jsonl(tmp / "items.jsonl", good_lines())
    return ["--items", str(items), "--n", "4"], "--n is 4 but the item set holds 3 items"


def unknown_dtype(tmp: Path) -> tuple[list[str], str]:
    return ["--dtypes", "bf16,fp8"], "Unknown dtype 'fp8'"


def unknown_model(tmp: Path) -> tuple[list[str], str]:
    return ["--model", "no-such-org-xyz/no-such-model"], "Unknown model"


def missing_model_folder(tmp: Path) -> tuple[list[str], str]:
    return ["--model", str(tmp / "nowhere")], "neither a model folder nor a GGUF file"


def out_under_a_file(tmp: Path) -> tuple[list[str], str]:
    blocker = tmp / "a-regular-file"
    blocker.write_text("not a folder")
    return ["--out", str(blocker / "run")], "is not writable"


def prompt_over_context(tmp: Path) -> tuple[list[str], str]:
    lines = [*good_lines(), json.dumps({"id": "huge", "prompt": "7 " * 700, "answer": "7"})]
    items = jsonl(tmp / "items.jsonl", lines)
    return ["--items", str(items)], "Item huge needs"


def unknown_plan(tmp: Path) -> tuple[list[str], str]:
    return ["--plan", "no-such-plan"], "Unknown stage plan 'no-such-plan'"


def bad_plan_file(tmp: Path) -> tuple[list[str], str]:
    plan = tmp / "plan.json"
    plan.write_text('{"stages": "nope"}')
    return ["--plan", str(plan)], "is not a valid plan"


def unknown_extractor(tmp: Path) -> tuple[list[str], str]:
    return ["--extractor", "roman-numerals"], "roman-numerals"


def unknown_items(tmp: Path) -> tuple[list[str], str]:
    return ["--items", "no-such-set"], "neither a built-in set"


CASES: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    f.__name__: f
    for f in (
        malformed, missing_field, missing_prompt, duplicate_ids, n_too_large, unknown_dtype,
        unknown_model, missing_model_folder, out_under_a_file, prompt_over_context,
        unknown_plan, bad_plan_file, unknown_extractor, unknown_items,
    )
}  # fmt: skip


def argv(experiment: str, case: str, tmp: Path, model: Path) -> tuple[list[str], str, Path]:
    extra, expected = CASES[case](tmp)
    args, out = run_args(experiment, tmp, model, extra)
    return args, expected, out


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_sentence_and_exit_2(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, expected, out = argv("matched", case, tmp_path, tiny_dirs["qwen2"])
    check(CliRunner().invoke(main, args), expected, out)


@pytest.mark.parametrize("experiment", ["fixed-prefix", "bridge"])
@pytest.mark.parametrize("case", ["malformed", "unknown_dtype", "n_too_large"])
def test_every_experiment_refuses_bad_input(
    experiment: str, case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    args, expected, out = argv(experiment, case, tmp_path, tiny_dirs["qwen2"])
    check(CliRunner().invoke(main, args), expected, out)


def test_unknown_experiment(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    args, _, out = argv("no-such-experiment", "unknown_plan", tmp_path, tiny_dirs["qwen2"])
    args[args.index("no-such-plan")] = "short"
    check(CliRunner().invoke(main, args), "Unknown experiment 'no-such-experiment'", out)


def test_n_too_large_can_then_run_in_the_same_folder(
    tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """The refusal leaves at most a manifest and items, which a corrected rerun accepts."""
    args, expected, out = argv("matched", "n_too_large", tmp_path, tiny_dirs["qwen2"])
    check(CliRunner().invoke(main, args), expected, out)
    args[args.index("--n") + 1] = "1"
    args[args.index("--plan") + 1] = "short"
    args += ["--dtypes", "fp32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (out / "matched_live_prefill.csv").is_file()


@pytest.mark.parametrize("case", ["prompt_over_context"])
def test_real_process_stderr_is_one_line(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    """In a real process, with whatever the libraries would print: still one line."""
    args, expected, out = argv("matched", case, tmp_path, tiny_dirs["qwen2"])
    proc = subprocess.run(
        [sys.executable, "-c", "from kvreplay.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert_one_sentence(proc.stderr, expected)
    assert_nothing_complete(out)
