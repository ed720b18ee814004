"""Traces produced elsewhere (``prefix_token_ids``) go through fixed-prefix as given, and
experiments that must generate live refuse them before any model work."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from click.testing import CliRunner

from kvreplay.cli import main
from kvreplay.core.canonical import sha256_tokens

PREFIX = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]


def trajectories(tmp_path: Path) -> Path:
    path = tmp_path / "traces.jsonl"
    rows = [
        {"id": "t0", "prefix_token_ids": PREFIX, "prompt_token_count": 8, "answer": "3"},
        {"id": "t1", "prefix_token_ids": PREFIX[::-1], "prompt_token_count": 5, "answer": 4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_fixed_prefix_uses_the_recorded_prefixes(tmp_path: Path, tiny_dirs: dict) -> None:
    out = tmp_path / "run"
    code, output = run(
        "run", "fixed-prefix", "--model", str(tiny_dirs["qwen2"]), "--plan", "short",
        "--items", str(trajectories(tmp_path)), "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    table = list(csv.DictReader((out / "fixed_prefix_2x2.csv").open()))
    assert [(r["row_id"], r["precision"]) for r in table] == [
        ("t0", "bf16"), ("t1", "bf16"), ("t0", "fp32"), ("t1", "fp32"),
    ]  # fmt: skip
    assert table[0]["prefix_sha256"] == sha256_tokens(PREFIX)
    assert table[1]["prefix_token_count"] == str(len(PREFIX))
    assert all(r["incremental_replica_cache_exact"] == "true" for r in table)
    records = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    prefix_rows = [r for r in records if r["data"].get("kind") == "prefix"]
    assert [r["data"]["source"]["key"] for r in prefix_rows] == [
        "items.jsonl:t0",
        "items.jsonl:t1",
    ]
    # the run's frozen items.jsonl (prompt: null) reads back, so the run can be audited
    code, output = run("audit", str(out))
    assert code == 0, output


def test_matched_refuses_trajectories_before_model_work(tmp_path: Path, tiny_dirs: dict) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main,
        ["run", "matched", "--model", str(tiny_dirs["qwen2"]), "--plan", "short",
         "--items", str(trajectories(tmp_path)), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "has only a recorded prefix" in result.output
    assert not out.exists()


def test_blind_transplant_panel_spreads_trajectories_by_prefix_length(
    tmp_path: Path, tiny_dirs: dict
) -> None:
    """Without --from, a blind panel orders trajectory items by their recorded prefix
    (they have no prompt to measure)."""
    path = tmp_path / "traces.jsonl"
    rows = [
        {"id": f"t{k}", "prefix_token_ids": PREFIX[: 6 + 2 * k], "prompt_token_count": 4,
         "answer": "3"}
        for k in range(4)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code, output = run(
        "run", "transplant", "--model", str(tiny_dirs["drift_qwen2"]), "--plan", "short",
        "--items", str(path), "--panel", "blind", "--n", "2", "--dtypes", "bf16",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    config = json.loads((out / "manifest.json").read_text())["experiments"]["transplant"]["config"]
    chosen = [row["item_id"] for row in config["selection"]["rows"]]
    assert chosen == ["t0", "t3"]  # the shortest and the longest prefix
