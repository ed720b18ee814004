"""Typed claims (issue 52): a section's claims are a dataclass, claims.json is their one
encoding, and reading it back gives the dataclasses again."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvreplay.analysis.claims import Claims
from kvreplay.analysis.sections.registry import sections
from kvreplay.core.claims import ClaimsError, decode, encode, key
from kvreplay.experiments.matrix.section import MATRIX, MatrixClaims
from kvreplay.experiments.transplant.section import TRANSPLANT, TransplantClaims

RESULTS = Path(__file__).resolve().parents[2] / "results"
COMMITTED = sorted(RESULTS.glob("*/claims.json"))


@dataclass(frozen=True)
class Point:
    hits: int
    x: int = field(metadata=key("{axis}"))


@dataclass(frozen=True)
class Block:
    rows: int
    left_correct: int = field(metadata=key("{left}_correct"))
    points: list[Point] = field(metadata=key(context={"axis": "layer"}))
    detail: str = field(metadata=key("detail_of_block", extra=True))
    gone: int | None = field(default=None, metadata=key(omit=True))


@dataclass(frozen=True)
class Part:
    precisions: dict[str, Block] = field(metadata=key(flatten=True))
    across: int | None = field(default=None, metadata=key(omit=True))


@dataclass(frozen=True)
class Toy:
    part: Part | None = field(default=None, metadata=key("toy_part", context={"left": "live"}))
    panels: dict[str, int] = field(default_factory=dict, metadata=key(flatten=True, prefix="p_"))
    note: str = field(default="n", metadata=key(extra=True))


TOY = Toy(
    Part({"bf16": Block(3, 2, [Point(1, 0), Point(2, 5)], "why")}, across=7),
    {"a": 1, "b": 2},
)
TOY_JSON = {
    "toy_part": {
        "bf16": {
            "rows": 3,
            "live_correct": 2,
            "points": [{"hits": 1, "layer": 0}, {"hits": 2, "layer": 5}],
        },
        "across": 7,
    },
    "p_a": 1,
    "p_b": 2,
    "extra": {"note": "n", "toy_part": {"bf16": {"detail_of_block": "why"}}},
}  # fmt: skip


def test_a_claims_type_encodes_its_keys_templates_extras_and_flattened_entries() -> None:
    assert encode(TOY) == TOY_JSON


def test_claims_json_decodes_to_the_same_types() -> None:
    assert decode(Toy, TOY_JSON) == TOY
    assert decode(Toy, {"schema": "s", "other_section": {}}) is None  # none of its keys


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c["toy_part"]["bf16"].pop("live_correct"), "toy_part.bf16.live_correct"),
        (lambda c: c["toy_part"]["bf16"].update(rows="3"), "toy_part.bf16.rows"),
        (lambda c: c["toy_part"]["bf16"].update(rows=True), "toy_part.bf16.rows"),
        (lambda c: c["extra"]["toy_part"]["bf16"].pop("detail_of_block"), "detail_of_block"),
        (lambda c: c["toy_part"]["bf16"]["points"][1].pop("layer"), "points[1].layer"),
    ],
)
def test_a_claims_json_that_is_not_its_type_is_refused_naming_the_key(change, named) -> None:
    data = json.loads(json.dumps(TOY_JSON))
    change(data)
    with pytest.raises(ClaimsError, match=named.replace("[", r"\[").replace("]", r"\]")):
        decode(Toy, data)


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_every_committed_claims_json_reads_as_its_sections_types_and_back(path: Path) -> None:
    """Each section's dataclass holds exactly what a committed run's claims.json says:
    decoded and encoded again, it is the same JSON."""
    data = json.loads(path.read_text(encoding="utf-8"))
    claims = Claims.from_json(data)
    assert claims.parts, path
    assert claims.to_json() == data


def test_the_report_reads_fields_not_keys() -> None:
    """A section's summary takes its dataclass: the matrix's left arm is a field, whatever
    claims.json calls it."""
    data = json.loads((RESULTS / "smollm2-n24" / "claims.json").read_text(encoding="utf-8"))
    matrix = Claims.from_json(data).of(MATRIX)
    assert isinstance(matrix, MatrixClaims) and matrix.matched and matrix.fixed_prefix
    live = data["matched_live_prefill"]["bf16"]
    assert matrix.matched.precisions["bf16"].left_correct == live["live_correct"]
    replay = data["fixed_prefix_2x2"]["bf16"]
    assert matrix.fixed_prefix.precisions["bf16"].left_correct == replay["incremental_correct"]
    transplant = json.loads((RESULTS / "transplant-c0-smollm2" / "claims.json").read_text())
    panels = Claims.from_json(transplant).of(TRANSPLANT)
    assert isinstance(panels, TransplantClaims) and set(panels.panels) == {"primary"}


def test_every_section_declares_its_claims_type() -> None:
    for section in sections():
        assert isinstance(section.claims_type, type), section.name
