"""The rollout section: the training-inference mismatch of a run's rollouts, from
``rollout_logprobs.csv`` (design: mismatch).

Per precision of the rollout stack: every scorer's metrics against the rollout's own
log-probabilities (:data:`kvreplay.experiments.rollout.metrics.METRICS`), where along the sequence
and at what top-1/top-2 gap the differences sit, and the first position where the
scorer's argmax is not the sampled token; the decomposition of each trainer's total
into the engine's own term (its prefill against its decode: the paper's live vs
prefill) and the cross-stack term (the trainer's prefill against the engine's), which
add up exactly, with paired 95% intervals that resample whole sequences; and the
controls: a later turn decoded after a prefix-cache miss instead of a hit, the first
turn decoded in a batch with other items. No torch.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvreplay.backends.rollout import ENGINE
from kvreplay.experiments.rollout.metrics import (
    DEFAULT_CAP,
    Decomposition,
    by_margin,
    by_position,
    first_argmax_divergence,
    metrics,
    term_interval,
)
from kvreplay.experiments.rollout.roll import MISS
from kvreplay.experiments.rollout.sides import Sequences, controls, read_sides
from kvreplay.experiments.rollout.table import ROLLOUT_SIDE, ROLLOUT_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.measure.rates import Json
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "rollout_mismatch"
TERMS = {
    "engine": "engine prefill - rollout decode (the stack's own live vs prefill)",
    "cross": "trainer prefill - engine prefill (kernels, precision, stack)",
    "cache": "decode after a prefix-cache miss - decode after a hit",
    "batch": "decode in a batch with other items - decode alone",
    "total": "trainer prefill - rollout decode",
}
"""Each term of a decomposition, as the report names it."""
HEADLINE = (
    "abs_logp_mean",
    "abs_logp_max",
    "probs_diff_max",
    "kl_k1",
    "kl_k3",
    "ratio_above_cap",
    "tokens_bit_equal",
)


def _stream(*names: str) -> int:
    """A bootstrap stream fixed by what is resampled (the terms of one decomposition
    share it: their intervals are paired)."""
    return zlib.crc32("/".join(names).encode()) % 1_000_000


def _json(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def term_summary(values: np.ndarray, sequence: np.ndarray, stream: int) -> Json:
    """One term's per-token mean (signed and absolute) with 95% intervals over resampled
    sequences, its largest magnitude, and how many tokens it moved at all."""
    signed = term_interval(values, sequence, stream)
    absolute = term_interval(values, sequence, stream, absolute=True)
    return {
        "mean": math.fsum(values.tolist()) / values.size,
        "ci95": None if signed is None else [signed.low, signed.high],
        "abs_mean": math.fsum(np.abs(values).tolist()) / values.size,
        "abs_ci95": None if absolute is None else [absolute.low, absolute.high],
        "max_abs": float(np.max(np.abs(values))),
        "tokens_moved": int(np.count_nonzero(values)),
    }


def decomposition_claims(d: Decomposition, names: Sequence[str], stream: int) -> Json:
    """A decomposition's terms (renamed ``names``) and total, each summarised on the same
    resamples, the term that moves log-probabilities most, and the paired interval of
    how much more it moves them than the next one."""
    pairs = list(zip(names, d.terms, strict=True))
    terms = {name: term_summary(t, d.sequence, stream) for name, t in pairs}
    ranked = sorted(pairs, key=lambda x: -terms[x[0]]["abs_mean"])
    lead: Json = {"term": ranked[0][0]}
    if len(ranked) > 1:
        gap = np.abs(ranked[0][1]) - np.abs(ranked[1][1])
        interval = term_interval(gap, d.sequence, stream)
        lead |= {
            "over": ranked[1][0],
            "abs_mean_difference": math.fsum(gap.tolist()) / gap.size,
            "ci95": None if interval is None else [interval.low, interval.high],
            # the interval of the difference lies above 0: the term does move more
            "decided": interval is not None and interval.low > 0,
        }
    return {
        "tokens": int(d.total.size),
        "sequences": d.sequences,
        "terms": terms,
        "total": term_summary(d.total, d.sequence, stream),
        "dominant": lead,
    }


def _scorer_claims(sequences: Sequences, scorer: str, greedy: bool) -> Json:
    pairs = sequences.pairs(scorer)
    reported = [s[scorer].argmax_differs for s in sequences.with_side(scorer)]
    firsts = [first_argmax_divergence(r) for r in reported if r is not None]
    parted = [f for f in firsts if f is not None]
    return {
        "metrics": {k: _json(v) for k, v in metrics(pairs, DEFAULT_CAP).items()},
        "by_position": [{k: _json(v) for k, v in b.items()} for b in by_position(pairs)],
        "by_margin": [{k: _json(v) for k, v in b.items()} for b in by_margin(pairs)],
        "argmax": {
            "greedy": greedy,
            "sequences": len(firsts),  # those whose scorer reported its argmax
            "sequences_parted": len(parted),
            "first_index_median": float(np.median(parted)) if parted else None,
        },
    }


def precision_claims(sequences: Sequences, temperature: float, precision: str) -> Json:
    """Everything the section says of one precision's sequences."""
    scorers = sequences.scorers()
    trainers = [s for s in scorers if s != ENGINE]
    claims: Json = {
        "temperature": temperature,
        "sequences": len(sequences.keys),
        "tokens": sum(len(s[ROLLOUT_SIDE].logprobs) for s in sequences.sides),
        "scorers": {s: _scorer_claims(sequences, s, temperature == 0) for s in scorers},
        "decomposition": {},
        "controls": {},
    }
    if ENGINE in scorers:
        for trainer in trainers:
            d = sequences.chain([ROLLOUT_SIDE, ENGINE, trainer])
            if d is not None:
                claims["decomposition"][trainer] = decomposition_claims(
                    d, ["engine", "cross"], _stream(precision, trainer)
                )
    for control in controls(sequences):
        claims["controls"][control] = _control_claims(sequences, control, trainers, precision)
    return claims


def _control_claims(
    sequences: Sequences, control: str, trainers: list[str], precision: str
) -> Json:
    """A control against the rollout: its term alone, and (a miss, where the engine
    scored) the chain rollout decode -> decode after a miss -> engine -> trainer."""
    name = "cache" if control == MISS else "batch"
    d = sequences.chain([ROLLOUT_SIDE, control])
    found: Json = {"term": name, "sequences": sum(1 for _ in sequences.with_side(control))}
    if d is None or not d.total.size:
        return found | {"tokens": 0}
    found |= decomposition_claims(d, [name], _stream(precision, control))
    hits = [s[ROLLOUT_SIDE].cached_tokens for s in sequences.with_side(control)]
    found["cached_tokens"] = {
        "rollout": [h for h in hits if h is not None],
        control: [s[control].cached_tokens for s in sequences.with_side(control)],
    }
    if control == MISS and ENGINE in sequences.scorers():
        found["chains"] = {}
        for trainer in trainers or [ENGINE]:
            names = [ROLLOUT_SIDE, MISS, ENGINE] + ([trainer] if trainer != ENGINE else [])
            chain = sequences.chain(names)
            if chain is not None and chain.total.size:
                terms = ["cache", "engine", "cross"][: len(names) - 1]
                found["chains"][trainer] = decomposition_claims(
                    chain, terms, _stream(precision, control, trainer)
                )
    return found


def rollout_claims(reading: Reading) -> Json:
    """The section's part of claims.json: its claims by precision."""
    (ledger,) = reading.ledgers.values()
    temperature = float(ledger["temperature"][0])
    return {
        SECTION: {
            precision: precision_claims(sequences, temperature, precision)
            for precision, sequences in read_sides(ledger).items()
        }
    }


def _ordered(mapping: Json) -> list[tuple[str, Any]]:
    """A claims mapping in the report's order, whatever order claims.json keeps its keys
    in: terms as :data:`TERMS` lists them, the engine first, the rest by name."""
    order = list(TERMS)
    return sorted(
        mapping.items(),
        key=lambda kv: (
            kv[0] != ENGINE,
            order.index(kv[0]) if kv[0] in order else len(order),
            kv[0],
        ),
    )


def _g(value: Any) -> str:
    return "—" if value is None else f"{value:.3g}"


def _ci(interval: list[float] | None) -> str:
    return "" if interval is None else f" [{interval[0]:.3g}, {interval[1]:.3g}]"


def dominance(lead: Json) -> str:
    """Which term dominates, as a sentence says it: the one whose mean |delta| is larger,
    where the paired interval of the difference lies above 0, else neither."""
    if "over" not in lead:
        return f"the {lead['term']} term alone"
    by = f"{_g(lead['abs_mean_difference'])}{_ci(lead['ci95'])}"
    if lead.get("decided"):
        return f"the {lead['term']} term dominates by {by}"
    return f"neither dominates: {lead['term']} exceeds {lead['over']} by {by}"


def summary_lines(claims: Json) -> list[str]:
    section = claims.get(SECTION)
    if not section:
        return []
    lines = []
    for precision, c in _ordered(section):
        for scorer, s in _ordered(c["scorers"]):
            m = s["metrics"]
            lines.append(
                f"rollout {precision} vs {scorer}: k3 KL {_g(m['kl_k3'])}, |dlogp| mean "
                f"{_g(m['abs_logp_mean'])} max {_g(m['abs_logp_max'])}, ratio > {DEFAULT_CAP:g} on "
                f"{_g(m['ratio_above_cap'])} of {int(m['tokens'])} tokens, bit-equal "
                f"{_g(m['tokens_bit_equal'])}"
            )
        for trainer, d in _ordered(c["decomposition"]):
            lead = d["dominant"]
            terms = d["terms"]
            lines.append(
                f"rollout {precision} -> {trainer}: mean |term| engine "
                f"{_g(terms['engine']['abs_mean'])}, cross {_g(terms['cross']['abs_mean'])}"
                f" ({dominance(lead)})"
            )
        for control, d in _ordered(c["controls"]):
            if d.get("tokens"):
                term = d["terms"][d["term"]]
                lines.append(
                    f"rollout {precision} {control}: {d['term']} term mean |dlogp| "
                    f"{_g(term['abs_mean'])}{_ci(term['abs_ci95'])} over {d['tokens']} tokens"
                )
    return lines


METHOD = (
    "Method. Each item's rollout is sampled by the rollout stack at the run's temperature "
    "(seeded), which reports the log-probability of every token it took (raw: the "
    "log-softmax of its logits, unless the run says processed). Each scorer then "
    "teacher-forces exactly those token ids after the same prompt and reports each "
    "position's log-probability: engine is the rollout stack's own one-shot prefill, the "
    "others are trainers. Per token, delta = log p(scorer) - log p(rollout); the total "
    "of a trainer splits exactly into engine (engine prefill - rollout decode) and cross "
    "(trainer prefill - engine prefill). Intervals are 95% percentile bootstraps that "
    "resample whole sequences, the same resamples for every term of a decomposition. "
    "Controls draw the same seed again and are compared over the tokens they share with "
    "the rollout: a later turn whose prompt missed the prefix cache (the rollout's hit "
    "it), and the first turn decoded in a batch with other items."
)


def _report(page: Page) -> list[Block]:
    section = page.claims.get(SECTION)
    if not section:
        return []
    blocks: list[Block] = [
        Heading("Rollout mismatch: does the trainer score the sampled tokens as the sampler did?"),
        Paragraph(METHOD),
    ]
    for precision, c in _ordered(section):
        blocks.append(
            Paragraph(
                f"Rollout stack at {precision}, temperature {c['temperature']:g}: "
                f"{c['sequences']} sampled turns, {c['tokens']} tokens."
            )
        )
        blocks.append(
            Grid(
                ("scorer", *HEADLINE),
                [(s, *(_g(v["metrics"][k]) for k in HEADLINE)) for s, v in _ordered(c["scorers"])],
            )
        )
        rows = []
        for trainer, d in _ordered(c["decomposition"]):
            for name, term in [*_ordered(d["terms"]), ("total", d["total"])]:
                rows.append(_term_row(trainer, name, term))
        for control, d in _ordered(c["controls"]):
            if d.get("tokens"):
                rows.append(_term_row(control, d["term"], d["terms"][d["term"]]))
            for trainer, chain in _ordered(d.get("chains", {})):
                for name, term in _ordered(chain["terms"]):
                    rows.append(_term_row(f"{control} -> {trainer}", name, term))
        for trainer, d in _ordered(c["decomposition"]):
            blocks.append(Paragraph(f"Decomposition of {trainer}: {dominance(d['dominant'])}."))
        if rows:
            blocks.append(
                Grid(
                    (
                        "chain",
                        "term",
                        "mean delta [95% CI]",
                        "mean |delta| [95% CI]",
                        "max |delta|",
                        "tokens moved",
                    ),
                    rows,
                )
            )
        for scorer, s in _ordered(c["scorers"]):
            if scorer == ENGINE and len(c["scorers"]) > 1:
                continue
            blocks.append(
                Grid(
                    (f"{scorer}: position (eighth)", "tokens", "mean |delta|", "large"),
                    [
                        (
                            str(b["eighth"]),
                            str(b["tokens"]),
                            _g(b["abs_logp_mean"]),
                            str(b["large"]),
                        )
                        for b in s["by_position"]
                    ],
                )
            )
            blocks.append(
                Grid(
                    (f"{scorer}: top-1/top-2 gap", "tokens", "mean |delta|", "large"),
                    [
                        (
                            _gap(b["margin_from"], b["margin_to"]),
                            str(b["tokens"]),
                            _g(b["abs_logp_mean"]),
                            str(b["large"]),
                        )
                        for b in s["by_margin"]
                    ],
                )
            )
            break
    return blocks


def _gap(low: float, high: float | None) -> str:
    return f"[{low:g}, {high:g})" if high is not None else f">= {low:g}"


def _term_row(chain: str, name: str, term: Json) -> tuple[str, ...]:
    return (
        chain,
        name,
        f"{_g(term['mean'])}{_ci(term['ci95'])}",
        f"{_g(term['abs_mean'])}{_ci(term['abs_ci95'])}",
        _g(term["max_abs"]),
        str(term["tokens_moved"]),
    )


ROLLOUT_SECTION = Section(
    "rollout", (ROLLOUT_TABLE,), rollout_claims, summary_lines, report=_report
)
