"""A verdict said: the sentence every check and run ends with, the JSON (schema
``kvreplay-check-v4``; v1 to v3 stay readable through :func:`read_json`), JUnit XML and
the one-screen report. Each reads a :class:`~kvreplay.verify.verdict.Verdict` and
judges nothing itself."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any
from xml.etree import ElementTree

from kvreplay.core.claims import encode
from kvreplay.core.errors import KvreplayError
from kvreplay.core.junit import xml_document
from kvreplay.core.power import percent, rate_upper_bound
from kvreplay.harness.experiment import Experiment
from kvreplay.ledger import Record
from kvreplay.verify.expectation import DEFAULT_MARGIN
from kvreplay.verify.outcome import ItemOutcome
from kvreplay.verify.verdict import Verdict, run_verdicts

SCHEMA = "kvreplay-check-v4"  # v4: the planted fault and a battery's shapes
READABLE = ("kvreplay-check-v1", "kvreplay-check-v2", "kvreplay-check-v3", SCHEMA)
NEAR_TIE = 0.5  # top-1/top-2 margin under which a divergence counts as a near-tie


def sentence(verdict: Verdict) -> str:
    """The verdict in one sentence: what holds or fails, at which level, where, and the
    power of a pass."""
    level = verdict.expectation.level
    word = "HOLDS" if verdict.holds else "FAILS"
    where = {"tokens": " at token level", "bits": " bitwise"}.get(level, "")
    planted = f" with the fault {verdict.planted_fault} planted" if verdict.planted_fault else ""
    expected = verdict.expectation.describe()
    battery = verdict.shapes
    if battery is not None and level == "tokens":
        where, expected = " at the measured level", "every request shape's hit as its miss"
    head = f"{word}{where} ({expected}){planted}: "
    if not verdict.reached:
        return head + "no item reached its boundary, so nothing was compared."
    if verdict.broken:
        return head + (
            f"replicas disagreed on {len(verdict.broken)} of {len(verdict.reached)} item(s), so "
            "this stack is not deterministic even under the same state."
        )
    if not verdict.judged:
        return head + (
            "no prefix-cache hit read a cached token of P on any item (P is shorter than "
            "one of the server's cache blocks), so hit and miss were the same computation; "
            "check longer prefixes or a smaller block size."
        )
    uncached = (
        f" ({len(verdict.uncached)} item(s) read no cached token of P: there hit and miss "
        "were the same computation)"
        if verdict.uncached
        else ""
    )
    if verdict.certificate is not None:
        return head + verdict.certificate.sentence + uncached + "; " + _bits_clause(verdict)
    if battery is not None:
        return head + _battery_clause(verdict, battery) + uncached + _stop_clause(verdict) + "."
    if level == "bits":
        body = _bits_clause(verdict, leading=True) + "; at token level " + _tokens_clause(verdict)
    else:
        body = _tokens_clause(verdict) + "; " + _bits_clause(verdict)
    return head + body + uncached + _stop_clause(verdict) + "."


def _battery_clause(verdict: Verdict, shapes: dict[str, Any]) -> str:
    """What the battery's shapes found: the first that parted hit from miss, or that
    none did, at which levels, over how many items, and which shapes did not run."""
    parted = verdict.divergent
    if parted:
        first = parted[0]
        shape = next(s for s in first.shapes or [] if s["detected"])
        return (
            f"the {shape['shape']} shape parted hit from miss on item {first.item_id} "
            f"({first.precision}): {shape['why']}, compared {_at(shape['level'])}; "
            f"{len(parted)} of {len(verdict.judged)} item(s) parted{_live(shapes)}"
        )
    levels = ", ".join(
        f"{', '.join(names)} {_at(level)}" for level, names in shapes["levels"].items()
    )
    unexercised = shapes["unexercised"]
    skipped = (
        "; not exercised: " + "; ".join(f"{name} ({why})" for name, why in unexercised.items())
        if unexercised
        else ""
    )
    return (
        f"no hit parted from its miss in {len(shapes['ran'])} request shape(s) on "
        f"{len(verdict.judged)} item(s) in {', '.join(shapes['precisions'])}, compared {levels}"
        f"{shapes['measured']}{skipped}" + _power(verdict, "tokens") + _live(shapes)
    )


def _live(shapes: dict[str, Any]) -> str:
    """The paper's question beside the battery: live decode vs a prefill of its tokens."""
    live = shapes["live"]
    if not live["items"]:
        return ""
    return (
        f"; beside it, the paper's question (the hit at a random cut of a greedy "
        f"continuation vs the live decode it cut): bit-equal on {live['equal']} of "
        f"{live['items']} item(s)"
    )


def _at(level: str) -> str:
    return {"bits": "bit for bit at the reported log-probabilities", "tokens": "at tokens"}[level]


def _tokens_clause(verdict: Verdict) -> str:
    left, right = verdict.compared
    parts = []
    for precision in dict.fromkeys(o.precision for o in verdict.reached):
        these = [o for o in verdict.reached if o.precision == precision]
        parts.append(
            f"{sum(o.pair_diverges for o in these)} of {len(these)} item(s) in {precision}"
        )
    pair = [o for o in verdict.reached if o.pair_diverges]
    near = [o for o in pair if o.left_margin is not None and o.left_margin < NEAR_TIE]
    tie = (
        f", {len(near)} of those at a near-tie (top-1/top-2 margin under {NEAR_TIE:g})"
        if pair
        else ""
    )
    clause = f"{left} and {right} continuations differ on {' and '.join(parts)}{tie}"
    if verdict.traffic is not None:
        differ = verdict.traffic["suffix_differs_from"]
        clause += (
            f"; under traffic the {left} continuation differs from the {left} alone on "
            f"{differ[left]} of {verdict.traffic['items']} item(s) and from the {right} on "
            f"{differ[right]}"
        )
    if not verdict.divergent and verdict.expectation.level == "tokens":
        clause += _power(verdict, "tokens")
    return clause


def _bits_clause(verdict: Verdict, leading: bool = False) -> str:
    left, right = verdict.compared
    judged = len(verdict.judged)
    if verdict.bits_differ:
        first = verdict.bits_differ[0]
        step = first.numeric_step
        at = f"from step {step}" + (" (the boundary logits)" if step == 0 else "")
        logits = sum(o.logits_equal is False for o in verdict.bits_differ)
        kv = sum(o.kv_equal is False for o in verdict.bits_differ)
        detail = f"; boundary logits differ on {logits}" + (
            f" and K/V on {kv}" if any(o.kv_equal is not None for o in verdict.judged) else ""
        )
        lead = "" if leading else "NOT bitwise: "
        return (
            f"{lead}{left} and {right} numerics differ on {len(verdict.bits_differ)} of "
            f"{judged} item(s), first at item {first.item_id} ({first.precision}) {at}"
            f"{detail}"
        )
    if verdict.bits_unknown:
        return (
            f"bitwise unknown: {len(verdict.bits_unknown)} of {judged} item(s) hold no step "
            "digests (rows written before kvreplay recorded them), so their numerics "
            "after the boundary were not compared"
        )
    what = (
        "K/V, boundary logits and every step's logits"
        if any(o.kv_equal is not None for o in verdict.judged)
        else "every step's reported logprobs"
    )
    clause = f"{'' if leading else 'bitwise too: '}{left} and {right} agree bit for bit "
    clause += f"({what}) on {judged} of {judged} item(s)"
    return clause + (_power(verdict, "bits") if verdict.expectation.level == "bits" else "")


def _power(verdict: Verdict, level: str) -> str:
    bound = verdict.rate_bound(level)
    assert bound is not None
    unit = "divergence rate" if level == "tokens" else "rate of items whose numerics part"
    return f", so the {unit} may still be up to {percent(bound)} (95% upper bound)"


def _stop_clause(verdict: Verdict) -> str:
    if not verdict.stopped_early:
        return ""
    return (
        f"; stopped after {len(verdict.items)} of {verdict.planned} planned item row(s), "
        "once the verdict was decided"
    )


def to_json(verdict: Verdict) -> dict[str, Any]:
    near = [o for o in verdict.divergent if o.left_margin is not None]
    return {
        "schema": SCHEMA,
        "verdict": "holds" if verdict.holds else "fails",
        "exit_code": verdict.exit_code,
        "sentence": sentence(verdict),
        "level": verdict.expectation.level,
        "levels": verdict.levels(),
        "power": {
            "level": verdict.expectation.level,
            "items": len(verdict.judged),
            "rate_upper_95": verdict.rate_bound(verdict.expectation.level),
            "max_rate": verdict.expectation.max_rate,
            "items_needed": verdict.expectation.items_needed(),
        },
        "planned": verdict.planned,
        "stopped_early": verdict.stopped_early,
        "near_ties": {
            "threshold": NEAR_TIE,
            "divergent": len(verdict.divergent),
            "at_near_tie": sum(o.left_margin < NEAR_TIE for o in near),  # type: ignore[operator]
        },
        "expectation": asdict(verdict.expectation),
        "compared": list(verdict.compared),
        "counts": verdict.counts(),
        "items": [o.to_json() for o in verdict.items],
        "certificate": None if verdict.certificate is None else encode(verdict.certificate),
        "environment": verdict.environment,
        "traffic": verdict.traffic,
        "planted_fault": verdict.planted_fault,
        "shapes": verdict.shapes,
    }


def junit(verdict: Verdict) -> str:
    """JUnit XML: one test case per item and precision, failed where it parts at the
    expectation's level; both levels as properties of the suite and of each case."""
    suite = ElementTree.Element(
        "testsuite",
        name="kvreplay check",
        tests=str(len(verdict.items)),
        failures=str(sum(not verdict.passes(o) for o in verdict.items)),
    )
    properties = ElementTree.SubElement(suite, "properties")
    for name, value in (
        ("verdict", "holds" if verdict.holds else "fails"),
        ("level", verdict.expectation.level),
        ("tokens", "holds" if verdict.levels()["tokens"]["holds"] else "fails"),
        ("bits", "holds" if verdict.bits_hold and verdict.judged else "fails"),
        ("rate_upper_95", f"{verdict.rate_bound(verdict.expectation.level) or 0:.6g}"),
        *(
            (f"traffic_suffix_differs_from_{arm}", str(count))
            for arm, count in (verdict.traffic or {}).get("suffix_differs_from", {}).items()
        ),
    ):
        ElementTree.SubElement(properties, "property", name=name, value=value)
    for outcome in verdict.items:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"kvreplay.check.{outcome.precision}",
            name=outcome.item_id,
        )
        props = ElementTree.SubElement(case, "properties")
        ElementTree.SubElement(props, "property", name="tokens", value=_tokens_word(outcome))
        ElementTree.SubElement(props, "property", name="bits", value=outcome.bits)
        if not verdict.passes(outcome):
            failure = ElementTree.SubElement(case, "failure", message=_why(outcome))
            failure.text = json.dumps(outcome.to_json(), sort_keys=True)
    ElementTree.SubElement(suite, "system-out").text = sentence(verdict)
    return xml_document(suite)


def screen(verdict: Verdict) -> str:
    """The one-screen report: the sentence first, then both levels, the counts and
    the items."""
    lines = [sentence(verdict), ""]
    levels = verdict.levels()
    for name in ("tokens", "bits"):
        level = levels[name]
        word = {True: "equal", False: "differ", None: "not judged"}[level["holds"]]
        bound = (
            f"; the rate may be up to {percent(level['rate_upper_95'])} at 95%"
            if level["holds"]
            else ""
        )
        lines.append(f"  {name}: {word} ({level['differ']} of {level['items']} differ{bound})")
    lines += [f"  {name.replace('_', ' ')}: {value}" for name, value in verdict.counts().items()]
    if verdict.traffic is not None and verdict.traffic["load"]:
        reported = ", ".join(
            f"{name.replace('_', ' ')} {value:g}"
            for name, value in verdict.traffic["load"].items()
            if value is not None
        )
        lines.append(f"  under traffic the server reported at most: {reported or 'nothing'}")
    for o in [o for o in verdict.items if not verdict.passes(o)][:10]:
        lines.append(f"  {o.item_id} ({o.precision}): {_why(o)}")
    return "\n".join(lines)


def run_sentence(experiment: Experiment, rows: list[Record], margin: float | None) -> str:
    """The sentence a ``kvreplay run`` ends with: its rows judged against the default
    expectation (every suffix equal; the certificate when sampled, per precision), with
    the bits level, the near-ties and the power beside it."""
    verdicts = run_verdicts(experiment, rows, DEFAULT_MARGIN if margin is None else margin)
    return " ".join(
        sentence(v) if precision is None else f"{precision}: {sentence(v)}"
        for precision, v in verdicts.items()
    )


def _tokens_word(outcome: ItemOutcome) -> str:
    if not outcome.reached:
        return "unreached"
    return "differ" if outcome.diverges else "equal"


def _why(outcome: ItemOutcome) -> str:
    if not outcome.reached:
        return "the prefix did not reach its boundary"
    if not outcome.replicas_ok:
        return "its replicas disagreed"
    if outcome.seeds_changed:
        return f"{outcome.seeds_changed} of {outcome.seeds} seeds changed"
    numerics = {
        "equal": "numerics bit-equal",
        "unknown": "numerics not recorded after the boundary",
        "differ": f"numerics part from step {outcome.numeric_step}",
    }[outcome.bits]
    traffic = "; under traffic the continuation differs from the one alone" * bool(
        outcome.traffic_differs
    )
    if not outcome.pair_diverges:
        return f"suffixes equal{traffic}; {numerics}"
    margins = (
        f"margins {outcome.left_margin:.3g} / {outcome.right_margin:.3g}"
        if (outcome.left_margin is not None and outcome.right_margin is not None)
        else "margins not recorded"
    )
    return f"suffixes part at token {outcome.first_divergence} ({margins}){traffic}; {numerics}"


@dataclass(frozen=True)
class VerdictRecord:
    """A verdict JSON as a reader needs it, whichever schema wrote it: a v1 file has no
    bits level (``levels['bits']`` is None) and no power."""

    schema: str
    verdict: str
    exit_code: int
    sentence: str
    levels: dict[str, Any]


def read_json(data: Any) -> VerdictRecord:
    """Read a verdict JSON of any readable schema; anything else is refused."""
    if not isinstance(data, dict) or data.get("schema") not in READABLE:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise KvreplayError(
            f"Not a kvreplay verdict (schema {schema!r}; readable: {', '.join(READABLE)})."
        )
    if data["schema"] != "kvreplay-check-v1":  # v2 and later have both levels
        levels = data["levels"]
    else:
        counts = data["counts"]
        levels = {
            "tokens": {
                "holds": counts["suffixes_differ"] == 0,
                "items": counts["reached"],
                "differ": counts["suffixes_differ"],
                "rate_upper_95": rate_upper_bound(counts["suffixes_differ"], counts["reached"]),
            },
            "bits": None,
        }
    return VerdictRecord(
        data["schema"], data["verdict"], data["exit_code"], data["sentence"], levels
    )
