"""``kvreplay run resample`` end to end on a tiny model (issue 14): the ledger, the CSV,
the manifest, analyze's certificate, the report, the audit (and a forged sample caught
by it), and bad input refused before anything is written."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from forgery import read_rows, rechain
from helpers import check, invoke

from kvreplay.cli import main
from kvreplay.experiments.resample.table import RESAMPLE_TABLE
from kvreplay.ledger import parse_rows

CSV = "resample_live_prefill.csv"
SAMPLES, REPLICA = 3, 2
ITEMS = [("r1", "What is 2+3?", "5"), ("r2", "Compute 4*5.", "20")]


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resample-items") / "items.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": p, "answer": a}) + "\n" for i, p, a in ITEMS)
    )
    return path


def args(model: Path, items: Path, out: Path, *extra: object) -> list[str]:
    return [str(a) for a in ("run", "resample", "--model", model, "--items", items,
                             "--plan", "short", "--n", 2, "--out", out, *extra)]  # fmt: skip


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path], items: Path
) -> Path:
    """bf16 and fp32, 2 items, 3 samples from seed 5, analysed and reported."""
    out = tmp_path_factory.mktemp("resample") / "run"
    extra = ("--samples", SAMPLES, "--replica-samples", REPLICA, "--seed", 5,
             "--temperature", 0.8, "--top-p", 0.9, "--margin", 0.1)  # fmt: skip
    for command in (
        args(tiny_dirs["qwen2"], items, out, *extra),
        ["analyze", out],
        ["report", out],
    ):
        result = CliRunner().invoke(main, [str(c) for c in command])
        assert result.exit_code == 0, (result.output, result.exception)
    return out


def csv_lines(folder: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO((folder / CSV).read_text(encoding="utf-8"))))


def test_rows_hold_every_seed_and_the_replicas_repeat_the_first(built: Path) -> None:
    rows = read_rows(built)
    assert [r["key"] for r in rows] == [
        f"resample/{i}/{p}" for p in ("bf16", "fp32") for i in ("r1", "r2")
    ]
    for row in rows:
        data: dict[str, Any] = row["data"]
        assert data["status"] == "ok" and data["arms"] == {}
        samples = data["samples"]
        assert {n: len(s) for n, s in samples.items()} == {
            "live": SAMPLES, "prefill": SAMPLES, "live_replica": REPLICA, "prefill_replica": REPLICA
        }  # fmt: skip
        for arm in ("live", "prefill"):
            replica = [s["suffix_sha256"] for s in samples[f"{arm}_replica"]]
            assert replica == [s["suffix_sha256"] for s in samples[arm][:REPLICA]]
            assert data["replicas"][arm]["suffix_exact"] is True
        assert data["resample"] == {"seeds": [5, 6, 7], "replica_samples": REPLICA,
                                    "margin": 0.1, "temperature": 0.8, "top_p": 0.9}  # fmt: skip
        # the seeds differ, so (on a random tiny model) the samples of one arm do too
        assert len({s["suffix_sha256"] for s in samples["live"]}) > 1


def test_manifest_records_the_sampling_and_the_seed_list(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["contract"]["run"]["sampler"] == {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    config = manifest["experiments"]["resample"]["config"]
    assert config == {
        "dtypes": ["bf16", "fp32"], "item_ids": ["r1", "r2"], "samples": SAMPLES,
        "seeds": [5, 6, 7], "replica_samples": REPLICA, "temperature": 0.8, "top_p": 0.9,
        "margin": 0.1, "batching": "singleton", "schema_version": RESAMPLE_TABLE.version,
    }  # fmt: skip


def test_csv_one_line_per_item_and_precision(built: Path) -> None:
    lines = csv_lines(built)
    assert [(x["row_id"], x["precision"]) for x in lines] == [
        (i, p) for p in ("bf16", "fp32") for i in ("r1", "r2")
    ]
    for line in lines:
        assert line["samples"] == str(SAMPLES) and line["seeds"] == "[5,6,7]"
        assert line["integrity_pass"] == "true"
        changed = json.loads(line["first_divergence_indices"])
        assert int(line["seeds_changed"]) == sum(i is not None for i in changed)
        answers = json.loads(line["live_answers"])
        counts = dict(map(tuple, json.loads(line["live_answer_distribution"])))
        assert sum(counts.values()) == len(answers) == SAMPLES


def test_analyze_writes_the_certificate_and_report_draws_it(built: Path) -> None:
    claims = json.loads((built / "claims.json").read_text())
    for precision in ("bf16", "fp32"):
        block = claims["resample"][precision]
        assert block["verdict"] in ("faithful", "not faithful", "undecided")
        assert block["margin"] == 0.1 and block["samples_per_item"] == SAMPLES
        assert set(block["per_item"]) == {"r1", "r2"}
        assert [row["margin"] for row in block["power"]] == [0.02, 0.05, 0.1, 0.2]
        assert (built / "figures" / f"resample_{precision}.png").is_file()
    report = (built / "report.md").read_text()
    section = report.split("## Resample: is resampling from a rebuilt prefix faithful?")[1]
    first = section.strip().splitlines()[0]
    assert first == f"bf16: {claims['resample']['bf16']['sentence']}"
    assert "Method." in section and "resample_bf16.png" in section
    assert "Headline, beside the paper" not in report  # the paper has no resample figure
    assert (built / "report.html").is_file()


def test_audit_reexecutes_resample_rows(run: Path) -> None:
    result = invoke("audit", run)
    assert result.exit_code == 0, result.output
    assert "rows in ledger: 4; re-executed: 4" in result.stdout


def test_audit_names_a_forged_sample(run: Path) -> None:
    """A careful forger edits one prefill sample's answer, rechains the ledger and
    re-derives the CSV: only re-execution can tell."""
    rows = read_rows(run)
    rows[1]["data"]["samples"]["prefill"][1]["answer"] = "42"
    rows[1]["data"]["samples"]["prefill"][1]["answer_parsed"] = True
    rechain(run, rows, derive_csv=False)
    records, _ = parse_rows(run / "rows.jsonl", rows[0]["contract"])
    config = json.loads((run / "manifest.json").read_text())["experiments"]["resample"]["config"]
    (run / CSV).write_text(RESAMPLE_TABLE.csv(records, config))
    result = invoke("audit", run)
    assert result.exit_code == 1, result.output
    key = rows[1]["key"]
    assert f"row {key}: field samples.prefill[1].answer differs on re-execution" in result.stdout


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--samples", 0), "'--samples': 0 is not in the range 1<=x<=10000"),
        (("--samples", -3), "'--samples': -3 is not in the range 1<=x<=10000"),
        (("--temperature", 0), "resample samples at a temperature above 0"),
        (("--margin", 0), "--margin is 0.0"),
        (("--margin", 1.5), "'--margin': 1.5 is not in the range 0<=x<=1"),
        (("--top-p", 0), "--top-p must be above 0"),
    ],
)
def test_bad_input_is_one_sentence_exit_2_and_writes_nothing(
    extra: tuple[object, ...],
    expected: str,
    tmp_path: Path,
    tiny_dirs: dict[str, Path],
    items: Path,
) -> None:
    out = tmp_path / "out"
    check(CliRunner().invoke(main, args(tiny_dirs["qwen2"], items, out, *extra)), expected, out)
    assert not out.exists()
