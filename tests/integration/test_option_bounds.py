"""Issue 49, item 3, through the command line: the numbers that grew a run until the kernel
killed it, ran it until killed, ended in a traceback or sampled past the model's context
are refused in one sentence before anything runs (no manifest left), on ``run rollout``
and on ``check --trainer``; so are scorers past the bound or naming one model twice, and
a run whose rows the one memory guard says no ledger line or this machine holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import check, invoke, write_items

CASES: dict[str, tuple[tuple[object, ...], str]] = {
    "a billion samples": (("--samples", 10**9), "'--samples': 1000000000 is not in the range"),
    "a billion tokens past EOS": (
        ("--max-tokens", 10**9, "--ignore-eos"),
        "'--max-tokens': 1000000000 is not in the range",
    ),
    "a million turns": (("--turns", 10**6), "'--turns': 1000000 is not in the range"),
    "10^11 turns": (("--turns", 10**11), "is not in the range"),
    "a temperature of 1e-300": (("--temperature", 1e-300), "use 0 (greedy) or at least"),
    "a temperature of NaN": (("--temperature", "nan"), "--temperature must lie between 0 and 100"),
    "a temperature of inf": (("--temperature", "inf"), "is not in the range"),
    "sampling past the context window": (
        ("--max-tokens", 1020),
        "past the model's context window of 1024",
    ),
    "turns past the context window": (
        ("--max-tokens", 600, "--turns", 2),
        "past the model's context window of 1024",
    ),
    "200 scorers": (("--scorers", ",".join(["hf:fp32"] * 200)), "it takes at most 8"),
    "rows no ledger line holds": (
        ("--samples", 1024, "--max-tokens", 900),
        "past the 64 MiB a ledger line holds",
    ),
}


# What a --trainer check takes of these (one rollout per item, one trainer), and values.
CHECK_TAKES = {"--max-tokens", "--ignore-eos", "--temperature", 10**9, 1e-300, "nan", "inf", 1020}


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_items(tmp_path_factory.mktemp("bounds") / "items.jsonl", ["2+3?"], "t", "5")


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_number_past_its_bound_is_refused_before_anything_runs(
    command: str, case: str, items: Path, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    extra, expected = CASES[case]
    if command == "check" and not set(extra) <= CHECK_TAKES:
        pytest.skip("a --trainer check takes the rollout's sampling options only")
    out = tmp_path / "out"
    base = ["--model", tiny_dirs["qwen2"], "--items", items, "--n", 1, "--dtypes", "fp32",
            "--out", out]  # fmt: skip
    trainer = ["--trainer", "hf:fp32"] if command == "check" else []
    args = [*(["run", "rollout"] if command == "run" else ["check"]), *base, *trainer, *extra]
    check(invoke(*args), expected, out)
    assert not (out / "manifest.json").exists()


def test_one_model_named_two_ways_is_one_scorer(
    items: Path, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_dirs["qwen2"]
    spellings = [f"hf:fp32@{model}/", f"hf:fp32@{model}/../{model.name}", "hf:fp32"]
    out = tmp_path / "out"
    result = invoke("run", "rollout", "--model", model, "--items", items, "--dtypes", "fp32",
                    "--scorers", ",".join(spellings), "--out", out)  # fmt: skip
    check(result, "names one scorer twice", out)
