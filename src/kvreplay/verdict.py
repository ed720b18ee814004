"""Verdicts (design: check, verdict, expectation): a run's rows judged against what
should hold. A matched row's compared continuations must agree (``exact``), at most K
items may part (``max-divergent``), or a sampled run's resample certificate must be
``faithful`` within a margin. ``kvreplay check`` and every ``kvreplay run`` end with a
verdict's sentence; JSON (schema ``kvreplay-check-v1``) and JUnit XML carry the rest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any
from xml.etree import ElementTree

from kvreplay.comparison import first_divergence
from kvreplay.errors import KvreplayError
from kvreplay.experiments.experiment import Experiment
from kvreplay.ledger import Record

SCHEMA = "kvreplay-check-v1"
EXPECTATIONS = ("exact", "max-divergent", "faithful")
DEFAULT_MARGIN = 0.05
HOLDS, FAILS = 0, 1  # exit codes; a refusal is 2


@dataclass(frozen=True)
class Expectation:
    """What the stack should do: ``exact`` (every suffix equal), ``max-divergent`` (at
    most ``max_divergent`` items differ), or ``faithful`` (the resample certificate at
    ``margin``, temperature > 0 only)."""

    kind: str
    max_divergent: int = 0
    margin: float = DEFAULT_MARGIN

    def describe(self) -> str:
        if self.kind == "exact":
            return "every suffix equal"
        if self.kind == "max-divergent":
            return f"at most {self.max_divergent} item(s) divergent"
        return f"faithful within the margin {self.margin:g}"


def parse_expectation(
    kind: str | None, max_divergent: int | None, margin: float | None, temperature: float
) -> Expectation:
    """The expectation a check runs against; the default is ``exact`` when greedy and
    ``faithful`` at temperature > 0. Bad combinations are refused in one sentence."""
    if kind is None:
        kind = "max-divergent" if max_divergent is not None else None
        kind = kind or ("faithful" if temperature > 0 else "exact")
    if kind not in EXPECTATIONS:
        raise KvreplayError(f"Unknown expectation {kind!r}; choose {', '.join(EXPECTATIONS)}.")
    if kind == "faithful" and temperature <= 0:
        raise KvreplayError(
            "--expect faithful compares sampled outcomes; give --temperature above 0."
        )
    if kind != "faithful" and temperature > 0:
        raise KvreplayError(
            f"--expect {kind} compares greedy continuations; at --temperature above 0 use "
            "--expect faithful."
        )
    if margin is not None and not 0 < margin < 1:
        raise KvreplayError(f"--margin must lie in (0, 1); got {margin:g}.")
    if margin is not None and kind != "faithful":
        raise KvreplayError("--margin applies to --expect faithful only.")
    if max_divergent is not None and kind != "max-divergent":
        raise KvreplayError("--max-divergent applies to --expect max-divergent only.")
    return Expectation(kind, max_divergent or 0, DEFAULT_MARGIN if margin is None else margin)


@dataclass(frozen=True)
class ItemOutcome:
    """One item at one precision: do the compared continuations agree, and where and how
    narrowly do they part (the top-1/top-2 margins at the first divergence; a flip on a
    near-tie has a margin near 0)."""

    item_id: str
    precision: str
    reached: bool
    replicas_ok: bool
    suffix_differs: bool = False
    answer_differs: bool = False
    label_flips: bool = False
    first_divergence: int | None = None
    left_margin: float | None = None
    right_margin: float | None = None
    seeds_changed: int | None = None  # resample: seeds whose sampled tokens changed
    seeds: int | None = None
    cache_hit_tokens: int | None = None  # served: cached tokens of P the hit read

    @property
    def diverges(self) -> bool:
        return self.suffix_differs or bool(self.seeds_changed)


def outcomes(experiment: Experiment, rows: list[Record]) -> list[ItemOutcome]:
    """Each compared row's outcome, in ledger order."""
    found = []
    for record in rows:
        data = record.data
        if data.get("kind") == "prefix":
            continue
        if data["status"] != "ok":
            found.append(ItemOutcome(data["item_id"], data["precision"], False, True))
            continue
        row = experiment.read_row(data)
        pairs = row.pairs
        changed = [a.suffix_sha256 != b.suffix_sha256 for a, b in pairs]
        left, right = pairs[0]
        index = first_divergence(left.suffix_token_ids, right.suffix_token_ids)
        found.append(
            ItemOutcome(
                item_id=data["item_id"],
                precision=data["precision"],
                reached=True,
                replicas_ok=row.replicas_exact,
                suffix_differs=len(pairs) == 1 and changed[0],
                answer_differs=any(a.answer != b.answer for a, b in pairs),
                label_flips=any(a.correct != b.correct for a, b in pairs),
                first_divergence=index,
                left_margin=left.margin_at(index),
                right_margin=right.margin_at(index),
                seeds_changed=sum(changed) if len(pairs) > 1 else None,
                seeds=len(pairs) if len(pairs) > 1 else None,
                cache_hit_tokens=left.served.cached_tokens[0] if left.served else None,
            )
        )
    return found


@dataclass
class Verdict:
    """A check's outcome against its expectation, with everything a CI system or a person
    needs: the sentence, the counts, each item, and the certificate when sampled."""

    expectation: Expectation
    compared: tuple[str, str]
    items: list[ItemOutcome]
    certificate: dict[str, Any] | None = None
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def divergent(self) -> list[ItemOutcome]:
        return [o for o in self.items if o.diverges]

    @property
    def broken(self) -> list[ItemOutcome]:
        """Items whose replicas disagreed: the stack is not deterministic there."""
        return [o for o in self.items if o.reached and not o.replicas_ok]

    @property
    def uncached(self) -> list[ItemOutcome]:
        """Served items whose hit read no cached token of P (P shorter than one cache
        block): there the hit was a second miss, and the item tests no caching."""
        return [o for o in self.items if o.reached and o.cache_hit_tokens == 0]

    @property
    def holds(self) -> bool:
        reached = [o for o in self.items if o.reached]
        if self.broken or not reached or len(self.uncached) == len(reached):
            return False
        if self.expectation.kind == "faithful":
            return self.certificate is not None and self.certificate["verdict"] == "faithful"
        limit = self.expectation.max_divergent if self.expectation.kind == "max-divergent" else 0
        return len(self.divergent) <= limit

    @property
    def exit_code(self) -> int:
        return HOLDS if self.holds else FAILS

    def sentence(self) -> str:
        left, right = self.compared
        reached = [o for o in self.items if o.reached]
        verdict = "HOLDS" if self.holds else "FAILS"
        head = f"{verdict} ({self.expectation.describe()}): "
        if not reached:
            return head + "no item reached its boundary, so nothing was compared."
        if self.broken:
            return head + (
                f"replicas disagreed on {len(self.broken)} of {len(reached)} item(s), so this "
                "stack is not deterministic even under the same state."
            )
        if len(self.uncached) == len(reached):
            return head + (
                "no prefix-cache hit read a cached token of P on any item (P is shorter than "
                "one of the server's cache blocks), so hit and miss were the same computation; "
                "check longer prefixes or a smaller block size."
            )
        uncached = (
            f" ({len(self.uncached)} item(s) read no cached token of P: there hit and miss "
            "were the same computation)"
            if self.uncached
            else ""
        )
        if self.certificate is not None:
            return head + self.certificate["sentence"] + uncached
        parts = []
        for precision in dict.fromkeys(o.precision for o in reached):
            these = [o for o in reached if o.precision == precision]
            parts.append(f"{sum(o.diverges for o in these)} of {len(these)} item(s) in {precision}")
        near = [o for o in self.divergent if o.left_margin is not None and o.left_margin < 0.5]
        tie = (
            f"; {len(near)} of those part at a near-tie (top-1/top-2 margin under 0.5)"
            if self.divergent
            else ""
        )
        return head + (
            f"{left} and {right} continuations differ on {' and '.join(parts)}{tie}{uncached}."
        )

    def counts(self) -> dict[str, int]:
        reached = [o for o in self.items if o.reached]
        return {
            "items": len(self.items),
            "reached": len(reached),
            "suffixes_differ": len(self.divergent),
            "answers_differ": sum(o.answer_differs for o in reached),
            "labels_flip": sum(o.label_flips for o in reached),
            "replicas_disagree": len(self.broken),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": "holds" if self.holds else "fails",
            "exit_code": self.exit_code,
            "sentence": self.sentence(),
            "expectation": asdict(self.expectation),
            "compared": list(self.compared),
            "counts": self.counts(),
            "items": [asdict(o) for o in self.items],
            "certificate": self.certificate,
            "environment": self.environment,
        }

    def junit(self) -> str:
        """JUnit XML: one test case per item and precision, failed where it diverges."""
        suite = ElementTree.Element(
            "testsuite",
            name="kvreplay check",
            tests=str(len(self.items)),
            failures=str(sum(not _passes(o) for o in self.items)),
        )
        for outcome in self.items:
            case = ElementTree.SubElement(
                suite,
                "testcase",
                classname=f"kvreplay.check.{outcome.precision}",
                name=outcome.item_id,
            )
            if not _passes(outcome):
                failure = ElementTree.SubElement(case, "failure", message=_why(outcome))
                failure.text = json.dumps(asdict(outcome), sort_keys=True)
        return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"

    def screen(self) -> str:
        """The one-screen report: the sentence first, then the counts and the items."""
        lines = [self.sentence(), ""]
        lines += [f"  {name.replace('_', ' ')}: {value}" for name, value in self.counts().items()]
        for o in self.divergent[:10]:
            lines.append(f"  {o.item_id} ({o.precision}): {_why(o)}")
        return "\n".join(lines)


def _passes(outcome: ItemOutcome) -> bool:
    return outcome.reached and outcome.replicas_ok and not outcome.diverges


def _why(outcome: ItemOutcome) -> str:
    if not outcome.reached:
        return "the prefix did not reach its boundary"
    if not outcome.replicas_ok:
        return "its replicas disagreed"
    if outcome.seeds_changed:
        return f"{outcome.seeds_changed} of {outcome.seeds} seeds changed"
    if not outcome.diverges:
        return "equal"
    margins = (
        f"margins {outcome.left_margin:.3g} / {outcome.right_margin:.3g}"
        if (outcome.left_margin is not None and outcome.right_margin is not None)
        else "margins not recorded"
    )
    return f"suffixes part at token {outcome.first_divergence} ({margins})"


def judge(
    experiment: Experiment,
    rows: list[Record],
    expectation: Expectation,
    environment: dict[str, Any] | None = None,
) -> Verdict:
    """The verdict of a run's rows; a sampled run is judged by its certificate."""
    items = outcomes(experiment, rows)
    certificate = None
    if any(o.seeds for o in items):
        certificate = _certificate(experiment, rows, expectation.margin)
    arms = experiment.panel.arms
    compared = (arms[0].construction, arms[1].construction)
    return Verdict(expectation, compared, items, certificate, environment or {})


def _certificate(experiment: Experiment, rows: list[Record], margin: float) -> dict[str, Any]:
    from kvreplay.analysis.certificate import PairedSamples, certify

    samples = []
    for record in rows:
        if record.data.get("kind") == "prefix" or record.data["status"] != "ok":
            continue
        pairs = experiment.read_row(record.data).pairs
        samples.append(
            PairedSamples(
                item=record.data["item_id"],
                live=tuple(a.answer for a, _ in pairs),
                prefill=tuple(b.answer for _, b in pairs),
                live_correct=tuple(a.correct for a, _ in pairs),
                prefill_correct=tuple(b.correct for _, b in pairs),
                changed=tuple(a.suffix_sha256 != b.suffix_sha256 for a, b in pairs),
            )
        )
    return certify(samples, margin).to_json()


def verdict_sentence(experiment: Experiment, rows: list[Record], margin: float | None) -> str:
    """The sentence a ``kvreplay run`` ends with: its rows judged against the default
    expectation (every suffix equal; the certificate when sampled)."""
    sampled = any(r.data.get("samples") for r in rows)
    kind = "faithful" if sampled else "exact"
    expectation = Expectation(kind, 0, margin or DEFAULT_MARGIN)
    if not sampled:
        return judge(experiment, rows, expectation).sentence()
    precisions = dict.fromkeys(r.data["precision"] for r in rows)
    return " ".join(
        f"{p}: "
        + judge(experiment, [r for r in rows if r.data["precision"] == p], expectation).sentence()
        for p in precisions
    )
