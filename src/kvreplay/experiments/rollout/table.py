"""The rollout CSV (``rollout_logprobs.csv``) and the typed row it is made from.

A row is one item at one precision of the rollout stack: per seed, each turn the stack
sampled (its tokens, the log-probability it reported for each, the cached prompt tokens
it reported), every scorer's teacher-forced pass over it and the controls (see
:mod:`kvreplay.experiments.rollout.roll`). The CSV has one line per (item, seed, turn,
side): the ``rollout`` decode, each scorer (``engine``: the stack's own prefill, then
the others by label) and each control, with the side's log-probabilities as a JSON
list. Every metric and term of the analysis is computed from these lines
(:mod:`kvreplay.experiments.rollout.metrics`); a control's lines say how many of its leading tokens
are the rollout's (``agree_tokens``), the only ones compared. Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvreplay.core.canonical import sha256_tokens
from kvreplay.core.rollout import Scored, Turn, common_length
from kvreplay.experiments.rollout.roll import BATCHED, MISS
from kvreplay.harness.columns import Column
from kvreplay.harness.table import Table
from kvreplay.ledger import Record

ROLLOUT = "rollout"
DECODE, PREFILL, CONTROL = "decode", "prefill", "control"
ROLLOUT_SIDE = "rollout"  # the side that sampled: the stack's decode
CONTROLS = (MISS, BATCHED)


@dataclass(frozen=True)
class TurnRecord:
    """One sampled turn with every scorer's pass over it and its controls."""

    turn: Turn
    scores: dict[str, Scored]
    controls: dict[str, Turn] = field(default_factory=dict)
    followup_token_ids: list[int] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        own = {k: data[k] for k in ("token_ids", "logprobs", "margins", "cached_tokens", "finish")}
        return cls(
            Turn.from_dict(own),
            {label: Scored.from_dict(s) for label, s in data["scores"].items()},
            {name: Turn.from_dict(t) for name, t in data.get("controls", {}).items()},
            data.get("followup_token_ids"),
        )


@dataclass(frozen=True)
class RolloutRow:
    """A completed rollout row: the item's first prompt, and per seed its turns."""

    item_id: str
    precision: str
    temperature: float
    prompt_token_ids: list[int]
    rollouts: list[tuple[int, list[TurnRecord]]]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutRow:
        return cls(
            data["item_id"],
            data["precision"],
            float(data["temperature"]),
            data["prompt_token_ids"],
            [
                (int(r["seed"]), [TurnRecord.from_dict(t) for t in r["turns"]])
                for r in data["rollouts"]
            ],
        )


@dataclass(frozen=True)
class SideLine:
    """A CSV line: one side of one sampled turn."""

    row: RolloutRow
    seed: int
    turn: int
    side: str
    kind: str
    token_ids: list[int]
    agree: int
    logprobs: list[float]
    margins: list[float] | None = None
    argmax_differs: list[list[int]] | None = None
    cached_tokens: int | None = None
    finish: str | None = None


def side_lines(rows: Iterable[Record]) -> Iterator[SideLine]:
    """Every side of every sampled turn of the completed rows, in ledger order (a turn's
    scorers and controls by name: a row read back from rows.jsonl has sorted keys)."""
    for record in rows:
        if record.data["status"] != "ok":
            continue
        row = RolloutRow.from_dict(record.data)
        for seed, turns in row.rollouts:
            for index, entry in enumerate(turns):
                turn, ids = entry.turn, entry.turn.token_ids
                yield SideLine(
                    row,
                    seed,
                    index,
                    ROLLOUT_SIDE,
                    DECODE,
                    ids,
                    len(ids),
                    turn.logprobs,
                    None,
                    None,
                    turn.cached_tokens,
                    turn.finish,
                )
                for label, scored in sorted(entry.scores.items()):
                    yield SideLine(
                        row,
                        seed,
                        index,
                        label,
                        PREFILL,
                        ids,
                        len(ids),
                        scored.logprobs,
                        scored.margins,
                        scored.argmax_differs,
                    )
                for name, control in sorted(entry.controls.items()):
                    yield SideLine(
                        row,
                        seed,
                        index,
                        name,
                        CONTROL,
                        control.token_ids,
                        common_length(ids, control.token_ids),
                        control.logprobs,
                        None,
                        None,
                        control.cached_tokens,
                        control.finish,
                    )


def _sequence_key(line: SideLine) -> str:
    return f"{line.row.item_id}/{line.seed}/{line.turn}"


COLUMNS: tuple[Column[SideLine], ...] = (
    Column("row_id", "text", get=lambda x: x.row.item_id),
    Column("precision", "text", get=lambda x: x.row.precision),
    Column("temperature", "float", get=lambda x: x.row.temperature),
    Column("seed", "int", get=lambda x: x.seed),
    Column("turn", "int", get=lambda x: x.turn),
    Column("sequence", "text", get=_sequence_key),
    Column("side", "text", get=lambda x: x.side),
    Column("kind", "text", get=lambda x: x.kind),
    Column("token_count", "int", get=lambda x: len(x.token_ids)),
    Column("agree_tokens", "int", get=lambda x: x.agree),
    Column("tokens_sha256", "sha256", get=lambda x: sha256_tokens(x.token_ids)),
    Column("logprobs", "float_list", get=lambda x: x.logprobs),
    Column("margins", "optional_float_list", get=lambda x: x.margins),
    Column("argmax_differs", "optional_json", get=lambda x: x.argmax_differs),
    Column("cached_tokens", "optional_int", get=lambda x: x.cached_tokens),
    Column("finish", "optional_text", get=lambda x: x.finish),
)


def check_line(line: Mapping[str, Any], first: Mapping[str, Any]) -> tuple[str, str] | None:
    """Gate on a line: one temperature throughout; a side is a decode, a prefill or a
    control; a decode or prefill line covers every token of its turn, a control at most
    its own; the list holds a value per token."""
    if line["temperature"] != first["temperature"]:
        return "temperature", "it must be the same on every row"
    if line["kind"] not in (DECODE, PREFILL, CONTROL):
        return "kind", "it must be a kind"
    count, agree = line["token_count"], line["agree_tokens"]
    if not (0 <= agree <= count and (line["kind"] == CONTROL or agree == count)):
        return "agree_tokens", "it is out of range"
    if len(line["logprobs"]) != count:
        return "logprobs", "it must hold one value per token"
    return None


ROLLOUT_TABLE = Table(
    "rollout_logprobs.csv",
    COLUMNS,
    ROLLOUT,
    side_lines,
    ("precision", "row_id", "seed", "turn", "side"),
    held=False,  # a line holds a whole response: read a line at a time, never held
    line_checks=(check_line,),
)
