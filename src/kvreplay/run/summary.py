"""The run summary: per precision, how often an experiment's two compared arms disagree,
whether replicas held, accuracy and timing; and its short terminal table."""

from __future__ import annotations

from typing import Any

from kvreplay.harness.experiment import Experiment
from kvreplay.harness.rows import PairLabels
from kvreplay.ledger import Record


def summarize(experiment: Experiment, rows: list[Record]) -> dict[str, Any]:
    """Counts per precision: rows, unreached, disagreements, replicas, accuracy, timing.
    Disagreement and accuracy count compared pairs: one per row, one per seed resampled."""
    by_precision: dict[str, dict[str, Any]] = {}
    for record in rows:
        data = record.data
        if data.get("kind") == "prefix":
            continue
        entry = by_precision.setdefault(
            data["precision"],
            {"rows": 0, "unreached": 0, "pairs": 0, "suffix_differs": 0, "answer_differs": 0,
             "label_flips": 0, "replicas_exact": 0, "left_correct": 0, "right_correct": 0,
             "unparsed_answers": 0, "model_s": 0.0, "harness_s": 0.0},
        )  # fmt: skip
        entry["rows"] += 1
        entry["model_s"] += record.timing.get("model_s", 0.0)
        entry["harness_s"] += record.timing.get("harness_s", 0.0)
        if data["status"] != "ok":
            entry["unreached"] += 1
            continue
        row = experiment.read_row(data)
        for left, right in row.pairs:
            labels = PairLabels.of(left, right)
            entry["pairs"] += 1
            entry["suffix_differs"] += not labels.suffix_equal
            entry["answer_differs"] += not labels.answer_equal
            entry["label_flips"] += left.correct != right.correct
            entry["left_correct"] += left.correct
            entry["right_correct"] += right.correct
            entry["unparsed_answers"] += (not left.answer_parsed) + (not right.answer_parsed)
        entry["replicas_exact"] += row.replicas_exact
    return {"experiment": experiment.name, "precisions": by_precision}


def format_summary(experiment: Experiment, summary: dict[str, Any]) -> str:
    """A short terminal table."""
    left, right = (arm.construction for arm in experiment.panel.arms[:2])
    header = (
        f"{'precision':<9} {'rows':>4} {'unreached':>9} {'suffix≠':>7} {'answer≠':>7} "
        f"{'flips':>5} {'replicas ok':>11} {left + ' acc':>9} {right + ' acc':>11} "
        f"{'unparsed':>8} {'s/row':>6} {'harness':>7}"
    )
    lines = [f"{experiment.name}: {left} vs {right}", header]
    for precision, e in summary["precisions"].items():
        ok = e["rows"] - e["unreached"]
        per_row = (e["model_s"] + e["harness_s"]) / max(e["rows"], 1)
        harness = e["harness_s"] / max(e["model_s"], 1e-9)
        lines.append(
            f"{precision:<9} {e['rows']:>4} {e['unreached']:>9} {e['suffix_differs']:>7} "
            f"{e['answer_differs']:>7} {e['label_flips']:>5} {e['replicas_exact']:>5}/{ok:<5} "
            f"{e['left_correct']:>4}/{e['pairs']:<4} {e['right_correct']:>6}/{e['pairs']:<4} "
            f"{e['unparsed_answers']:>8} {per_row:>6.1f} {harness:>6.1%}"
        )
    return "\n".join(lines)
