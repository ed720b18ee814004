"""The weight-update CSV (``weight_update.csv``): one line per item, precision and arm
(design: weight update arm). Arms: ``before`` (sampled under the run's own weights, the
cache filled), ``after`` (the same request right after the weights were synced),
``miss`` (again after a reset: the reference), ``inflight`` (a rollout whose weights
were updated once it had sampled ``update_at`` tokens), the engine's own prefill under
the new weights of the miss's and the in-flight rollout's tokens (``miss:engine``,
``inflight:engine``) and each trainer's of the in-flight rollout's
(``inflight:trainer:LABEL``). Like the rollout CSV, a line holds a whole response: the table is
read a line at a time, never held. Plain data, no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvreplay.core.canonical import sha256_tokens
from kvreplay.harness.columns import Column
from kvreplay.harness.table import Table
from kvreplay.ledger import Record

WEIGHT_UPDATE = "weight-update"
DECODE, PREFILL = "decode", "prefill"
ARMS = ("before", "after", "miss", "inflight")
"""The decoded arms, in the order a row records and the CSV writes them."""
SCORED = {"miss:engine": "miss", "inflight:engine": "inflight"}
"""The engine's prefill of an arm's tokens under the new weights, by the line it writes."""
TRAINED = "inflight:trainer:"
"""A trainer's prefill of the in-flight rollout's tokens under the new weights: the line's
arm is this and the trainer's label."""


@dataclass(frozen=True)
class ArmLine:
    """A CSV line: one arm of one row (or the engine's prefill of one)."""

    row: Mapping[str, Any]
    arm: str
    kind: str
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int | None
    finish: str | None
    update_at: int | None


def arm_lines(rows: Iterable[Record]) -> Iterator[ArmLine]:
    """Every arm of the completed rows, in ledger order."""
    for record in rows:
        row = record.data
        if row["status"] != "ok":
            continue
        for arm in ARMS:
            turn = row.get(arm)
            if turn is None:  # an engine that cannot update a request in flight
                continue
            at = row["update_at"] if arm == "inflight" else None
            yield ArmLine(row, arm, DECODE, turn["token_ids"], turn["logprobs"],
                          turn["cached_tokens"], turn["finish"], at)  # fmt: skip
        for line, arm in SCORED.items():
            scored, turn = row.get(line.replace(":engine", "_prefill")), row.get(arm)
            if scored is not None and turn is not None:
                yield ArmLine(row, line, PREFILL, turn["token_ids"], scored["logprobs"],
                              None, None, None)  # fmt: skip
        for label, scored in sorted(row.get("inflight_scores", {}).items()):
            yield ArmLine(row, TRAINED + label, PREFILL, row["inflight"]["token_ids"],
                          scored["logprobs"], None, None, None)  # fmt: skip


COLUMNS: tuple[Column[ArmLine], ...] = (
    Column("row_id", "text", get=lambda x: x.row["item_id"]),
    Column("precision", "text", get=lambda x: x.row["precision"]),
    Column("temperature", "float", get=lambda x: x.row["temperature"]),
    Column("arm", "text", get=lambda x: x.arm),
    Column("kind", "text", get=lambda x: x.kind),
    Column("token_count", "int", get=lambda x: len(x.token_ids)),
    Column("tokens_sha256", "sha256", get=lambda x: sha256_tokens(x.token_ids)),
    Column("logprobs", "float_list", get=lambda x: x.logprobs),
    Column("cached_tokens", "optional_int", get=lambda x: x.cached_tokens),
    Column("update_at", "optional_int", get=lambda x: x.update_at),
    Column("finish", "optional_text", get=lambda x: x.finish),
)


def check_line(line: Mapping[str, Any], first: Mapping[str, Any]) -> tuple[str, str] | None:
    """Gate on a line: one temperature throughout, a known arm and kind, a value per
    token."""
    if line["temperature"] != first["temperature"]:
        return "temperature", "it must be the same on every row"
    scored = line["arm"] in SCORED or str(line["arm"]).startswith(TRAINED)
    if line["arm"] not in ARMS and not scored:
        return "arm", "it must be an arm"
    if line["kind"] != (PREFILL if scored else DECODE):
        return "kind", "it must be the arm's kind"
    if len(line["logprobs"]) != line["token_count"]:
        return "logprobs", "it must hold one value per token"
    return None


UPDATE_TABLE = Table(
    "weight_update.csv",
    COLUMNS,
    WEIGHT_UPDATE,
    arm_lines,
    ("precision", "row_id", "arm"),
    held=False,
    line_checks=(check_line,),
)
