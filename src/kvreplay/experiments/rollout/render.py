"""A mismatch verdict's renderings (design: judgment apart from rendering): the sentence,
the JSON of ``--json``, the JUnit XML of ``--junit`` and the screen, each read from the
:class:`~kvreplay.experiments.rollout.verdict.MismatchVerdict` value and judging nothing again."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any
from xml.etree import ElementTree

from kvreplay.core.junit import xml_document
from kvreplay.core.power import percent, rate_upper_bound
from kvreplay.experiments.rollout.claims import plain
from kvreplay.experiments.rollout.metrics import SequenceOutcome
from kvreplay.experiments.rollout.section import count, dominance, number, trend_sentence
from kvreplay.experiments.rollout.verdict import SCHEMA, MismatchVerdict


def mismatch_sentence(v: MismatchVerdict) -> str:
    """The verdict in one sentence: the level it holds or fails at, and the other."""
    word = "HOLDS" if v.holds else "FAILS"
    where = "bitwise" if v.expectation.bitwise else "at the numbers level"
    head = f"{word} {where} ({v.expectation.describe()}): "
    if not v.sequences:
        return head + "no rollout was sampled, so nothing was compared."
    pair = f"{v.rollout} decode vs {v.trainer}"
    n = len(v.sequences)
    numbers = (
        f"k3 KL {v.kl_k3:.3g}"
        + (f" (95% upper bound {v.kl_k3_upper:.3g})" if v.kl_k3_upper is not None else "")
        + f", largest |delta log p| {v.abs_logp_max:.3g}"
    )
    if v.expectation.max_abs_logp is not None:
        numbers += (
            f", {v.beyond} of {n} sequence(s) with a token beyond {v.expectation.max_abs_logp:g}"
        )
    if v.parted:
        first = v.parted[0]
        bits = (
            f"log-probabilities differ on {len(v.parted)} of {n} sequence(s), first at "
            f"{first.key} ({first.precision}) token {first.first_differs}"
        )
    else:
        bits = f"every token's log-probability is the same float on {n} of {n} sequence(s)"
    bound = percent(rate_upper_bound(len(v.parted), n))
    power = f", so the rate of sequences that part may still be up to {bound} (95% upper bound)"
    growth = ""
    if v.alarms:
        growth = f"; the k3 KL grows step over step ({', '.join(v.alarms)})"
    elif v.expectation.growth:
        growth = "; no growth step over step"
    if v.expectation.bitwise:
        return head + f"{pair}: {bits}" + (power if not v.parted else "") + f"; {numbers}{growth}."
    not_bitwise = "NOT bitwise: " if v.parted else "bitwise too: "
    return head + f"{pair} over {v.tokens} tokens: {numbers}; {not_bitwise}{bits}{growth}."


def mismatch_json(v: MismatchVerdict) -> dict[str, Any]:
    """The verdict as ``--json`` writes it (schema ``kvreplay-mismatch-v1``)."""
    levels = v.levels()
    return {
        "schema": SCHEMA,
        "verdict": "holds" if v.holds else "fails",
        "exit_code": v.exit_code,
        "sentence": mismatch_sentence(v),
        "level": v.expectation.level,
        "levels": levels,
        "power": {
            "level": v.expectation.level,
            "sequences": len(v.sequences),
            "tokens": v.tokens,
            "rate_upper_95": levels["bits"]["rate_upper_95"],
            "kl_k3_upper_95": v.kl_k3_upper,
        },
        "expectation": asdict(v.expectation),
        "rollout": v.rollout,
        "trainer": v.trainer,
        "sequences": [{**asdict(s), "bits_equal": s.bits_equal} for s in v.sequences],
        "claims": plain(v.claims),
        "environment": v.environment,
    }


def mismatch_junit(v: MismatchVerdict) -> str:
    """JUnit XML: one test case per sampled turn (failed where it breaks what a
    sequence alone can break), and one for the pooled k3 KL at the numbers level."""
    cases = [(s.key, s.precision, v.passes(s), s) for s in v.sequences]
    bound = None if v.expectation.bitwise else v.expectation.max_k3_kl
    pooled_fails = bound is not None and v.kl_k3 > bound
    failures = sum(not ok for _, _, ok, _ in cases) + pooled_fails
    suite = ElementTree.Element(
        "testsuite", name="kvreplay check --trainer",
        tests=str(len(cases) + (bound is not None)), failures=str(failures),
    )  # fmt: skip
    properties = ElementTree.SubElement(suite, "properties")
    for name, value in (
        ("verdict", "holds" if v.holds else "fails"),
        ("level", v.expectation.level),
        ("bits", "holds" if v.bits_hold else "fails"),
        ("numbers", "holds" if v.numbers_hold else "fails"),
        ("kl_k3", f"{v.kl_k3:.6g}"),
        ("abs_logp_max", f"{v.abs_logp_max:.6g}"),
    ):
        ElementTree.SubElement(properties, "property", name=name, value=value)
    for key, precision, ok, outcome in cases:
        case = ElementTree.SubElement(
            suite, "testcase", classname=f"kvreplay.mismatch.{precision}", name=key
        )
        if not ok:
            failure = ElementTree.SubElement(case, "failure", message=_why(outcome))
            failure.text = json.dumps(asdict(outcome), sort_keys=True)
    if bound is not None:
        case = ElementTree.SubElement(
            suite, "testcase", classname="kvreplay.mismatch", name="kl_k3"
        )
        if pooled_fails:
            message = f"k3 KL {v.kl_k3:.3g} above {bound:g}"
            ElementTree.SubElement(case, "failure", message=message)
    ElementTree.SubElement(suite, "system-out").text = mismatch_sentence(v)
    return xml_document(suite)


def mismatch_screen(v: MismatchVerdict) -> str:
    """What the terminal shows: the sentence, both levels, the decomposition, failures."""
    levels = v.levels()
    lines = [mismatch_sentence(v), ""]
    bits = levels["bits"]
    lines.append(f"  bits: {'equal' if bits['holds'] else 'differ'} "
                 f"({bits['differ']} of {bits['sequences']} sequences differ)")  # fmt: skip
    numbers = levels["numbers"]
    lines.append(
        f"  numbers: {'within' if numbers['holds'] else 'beyond'} (k3 KL "
        f"{numbers['kl_k3']:.3g}, largest |delta log p| {numbers['abs_logp_max']:.3g})"
    )
    for precision, c in v.claims.items():
        scored = c.scorers.get(v.trainer)
        if scored is not None:
            m = scored.metrics
            lines.append(
                f"  {precision}: sequence ratio {number(m['seq_ratio_min'])} to "
                f"{number(m['seq_ratio_max'])}; verl's default truncates "
                f"{count(m['seq_truncated_verl'])} and TRL's masks {count(m['seq_masked_trl'])} "
                f"of {count(m['sequences'])} sequences"
            )
        d = c.decomposition.get(v.trainer)
        if d is not None:
            terms = d.split.terms
            lines.append(
                f"  {precision}: mean |delta| engine {terms['engine'].abs_mean:.3g}, "
                f"cross {terms['cross'].abs_mean:.3g} ({dominance(d.split.dominant)})"
            )
        steps = (c.steps or {}).get(v.trainer)
        if steps is not None:
            lines.append(f"  {precision} by step: {trend_sentence(steps.trend)}")
    for outcome in [s for s in v.sequences if not v.passes(s)][:10]:
        lines.append(f"  {outcome.key} ({outcome.precision}): {_why(outcome)}")
    return "\n".join(lines)


def _why(outcome: SequenceOutcome) -> str:
    if outcome.bits_equal:
        return f"every token bit-equal; largest |delta log p| {outcome.abs_logp_max:.3g}"
    return (
        f"log-probabilities differ from token {outcome.first_differs}; largest |delta log p| "
        f"{outcome.abs_logp_max:.3g}, k3 KL {outcome.kl_k3:.3g}"
    )
