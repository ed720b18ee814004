"""The rollout section: the training-inference mismatch of a run's rollouts, from
``rollout_logprobs.csv`` (design: mismatch), read a line at a time
(:mod:`kvreplay.experiments.rollout.tally` measures it in one pass).

Per precision of the rollout stack: every scorer's metrics against the rollout's own
log-probabilities (:data:`kvreplay.experiments.rollout.metrics.METRICS`), token- and
sequence-level, where along the sequence and at what top-1/top-2 gap the differences
sit, and the first position where the scorer's argmax is not the sampled token; the
decomposition of each trainer's total into the engine's own term (its prefill against
its decode: the paper's live vs prefill) and the cross-stack term (the trainer's prefill
against the engine's), which add up exactly, with paired 95% intervals that resample
whole sequences; the controls: a later turn decoded after a prefix-cache miss instead
of a hit, the first turn decoded in a batch with other items; and where rollouts carry
steps, the mismatch by step with its trend. No torch.
"""

from __future__ import annotations

from typing import Any

from kvreplay.backends.rollout import OWN_PREFILL
from kvreplay.experiments.rollout.claims import (
    GroupClaims,
    Interval,
    Lead,
    RolloutClaims,
    Term,
    Trend,
)
from kvreplay.experiments.rollout.metrics import (
    COUNTS,
    DEFAULT_CAP,
    TRL_SEQUENCE_CAP,
    VERL_SEQUENCE_THRESHOLD,
)
from kvreplay.experiments.rollout.sides import rollouts
from kvreplay.experiments.rollout.table import ROLLOUT_TABLE
from kvreplay.experiments.rollout.tally import measure
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

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
SEQUENCE_HEADLINE = (
    "seq_ratio_min",
    "seq_ratio_median",
    "seq_ratio_max",
    "seq_truncated_verl",
    "seq_masked_trl",
    "chi2_seq",
    "ess_seq",
)


def rollout_claims(reading: Reading) -> RolloutClaims:
    """The section's claims by group, the CSV read once, a line at a time."""
    (ledger,) = reading.ledgers.values()
    return RolloutClaims(measure(rollouts(ledger.file, ledger.lines())).claims())


def _ordered(mapping: dict[str, Any]) -> list[tuple[str, Any]]:
    """A claims mapping in the report's order, whatever order claims.json keeps its keys
    in: terms as :data:`TERMS` lists them, the engine first, the rest by name."""
    order = list(TERMS)
    return sorted(
        mapping.items(),
        key=lambda kv: (
            kv[0] != OWN_PREFILL,
            order.index(kv[0]) if kv[0] in order else len(order),
            kv[0],
        ),
    )


def number(value: Any) -> str:
    """A number as the summary and the report print it (three digits; — where none)."""
    return "—" if value is None else f"{value:.3g}"


def _ci(interval: Interval | None) -> str:
    return "" if interval is None else f" [{interval[0]:.3g}, {interval[1]:.3g}]"


def dominance(lead: Lead) -> str:
    """Which term dominates, as a sentence says it: the one whose mean |delta| is larger,
    where the paired interval of the difference lies above 0, else neither."""
    c = lead.comparison
    if c is None:
        return f"the {lead.term} term alone"
    by = f"{number(c.abs_mean_difference)}{_ci(c.ci95)}"
    if c.decided:
        return f"the {lead.term} term dominates by {by}"
    return f"neither dominates: {lead.term} exceeds {c.over} by {by}"


def count(value: float | None) -> str:
    """A count as a count."""
    return "—" if value is None else str(int(value))


def _temperature(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"


def summary_lines(groups: dict[str, GroupClaims]) -> list[str]:
    lines = []
    for precision, c in _ordered(groups):
        for scorer, s in _ordered(c.scorers):
            m = s.metrics
            tokens, sequences = count(m["tokens"]), count(m["sequences"])
            above = None if m["ratio_above_cap"] is None else m["ratio_above_cap"] * m["tokens"]
            lines.append(
                f"rollout {precision} vs {scorer}: k3 KL {number(m['kl_k3'])}, |dlogp| mean "
                f"{number(m['abs_logp_mean'])} max {number(m['abs_logp_max'])}, "
                f"ratio > {DEFAULT_CAP:g} on {count(above and round(above))} of {tokens} tokens, "
                f"bit-equal {number(m['tokens_bit_equal'])}; sequence ratio "
                f"{number(m['seq_ratio_min'])} to "
                f"{number(m['seq_ratio_max'])}, verl truncates {count(m['seq_truncated_verl'])} "
                f"and TRL masks {count(m['seq_masked_trl'])} of {sequences} sequences"
            )
        for trainer, d in _ordered(c.decomposition):
            terms = d.split.terms
            lines.append(
                f"rollout {precision} -> {trainer}: mean |term| engine "
                f"{number(terms['engine'].abs_mean)}, cross {number(terms['cross'].abs_mean)}"
                f" ({dominance(d.split.dominant)})"
            )
        for control, d in _ordered(c.controls):
            if d.split is not None:
                term = d.split.terms[d.term]
                lines.append(
                    f"rollout {precision} {control}: {d.term} term mean |dlogp| "
                    f"{number(term.abs_mean)}{_ci(term.abs_ci95)} over {d.tokens} tokens"
                )
        for scorer, steps in _ordered(c.steps or {}):
            lines.append(f"rollout {precision} vs {scorer} by step: {trend_sentence(steps.trend)}")
    return lines


def trend_sentence(trend: Trend) -> str:
    """The trend of the k3 KL over steps, as a line says it."""
    if trend.steps < 2:
        return f"{trend.steps} step, no trend"
    head = (
        f"k3 KL {number(trend.first)} at the first of {trend.steps} steps, "
        f"{number(trend.last)} at the last (Sen's slope "
        f"{number(trend.slope_per_step)} a step, "
        f"Kendall's tau {trend.tau:.2f}, one-sided p {number(trend.p_value)})"
    )
    if trend.alarm:
        return f"ALARM: the mismatch grows step over step: {head}"
    return head + ("" if trend.steps >= 4 else "; 4 steps are needed for an alarm")


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
    "it), and the first turn decoded in a batch with other items. A sequence's importance "
    "ratio is the product of its tokens' ratios, exp(sum of delta): verl's default "
    f"correction truncates it at {VERL_SEQUENCE_THRESHOLD:g}, TRL's masks a sequence above "
    f"{TRL_SEQUENCE_CAP:g}."
)


def _report(page: Page[RolloutClaims]) -> list[Block]:
    groups = page.claims.precisions
    if not groups:
        return []
    blocks: list[Block] = [
        Heading("Rollout mismatch: does the trainer score the sampled tokens as the sampler did?"),
        Paragraph(METHOD),
    ]
    for precision, c in _ordered(groups):
        blocks += _group_blocks(precision, c)
    return blocks


def _group_blocks(precision: str, c: GroupClaims) -> list[Block]:
    """One group's part of the report: its scorers' metrics, its steps, its
    decompositions and controls, and where the first trainer's differences sit."""
    kept = "." if c.kept_tokens is None else f", {c.kept_tokens} of them kept by their masks."
    blocks: list[Block] = [
        Paragraph(
            f"Rollout stack at {precision}, temperature {_temperature(c.temperature)}: "
            f"{c.sequences} sampled turns, {c.tokens} tokens" + kept
        ),
        Grid(
            ("scorer", *HEADLINE),
            [(s, *(number(v.metrics[k]) for k in HEADLINE)) for s, v in _ordered(c.scorers)],
        ),
        Grid(
            ("scorer (per sequence)", *SEQUENCE_HEADLINE),
            [
                (s, *(_metric(v.metrics, k) for k in SEQUENCE_HEADLINE))
                for s, v in _ordered(c.scorers)
            ],
        ),  # fmt: skip
    ]
    for scorer, steps in _ordered(c.steps or {}):
        blocks.append(Paragraph(f"{scorer} by step: {trend_sentence(steps.trend)}."))
        blocks.append(
            Grid(
                (f"{scorer}: step", "sequences", "tokens", "k3 KL", "mean |delta|",
                 "verl truncates", "TRL masks"),
                [(str(r.step), str(r.sequences), str(r.tokens), number(r.kl_k3),
                  number(r.abs_logp_mean), str(r.seq_truncated_verl), str(r.seq_masked_trl))
                 for r in steps.by_step],
            )
        )  # fmt: skip
    for trainer, d in _ordered(c.decomposition):
        blocks.append(Paragraph(f"Decomposition of {trainer}: {dominance(d.split.dominant)}."))
    rows = _term_rows(c)
    if rows:
        header = ("chain", "term", "mean delta [95% CI]", "mean |delta| [95% CI]",
                  "max |delta|", "tokens moved")  # fmt: skip
        blocks.append(Grid(header, rows))
    return blocks + _bin_grids(c)


def _term_rows(c: GroupClaims) -> list[tuple[str, ...]]:
    """Every term of the decompositions, the controls and the chains through them."""
    rows = []
    for trainer, d in _ordered(c.decomposition):
        for name, term in [*_ordered(d.split.terms), ("total", d.split.total)]:
            rows.append(_term_row(trainer, name, term))
    for control, k in _ordered(c.controls):
        if k.split is not None:
            rows.append(_term_row(control, k.term, k.split.terms[k.term]))
        for trainer, chain in _ordered(k.chains or {}):
            for name, term in _ordered(chain.split.terms):
                rows.append(_term_row(f"{control} -> {trainer}", name, term))
    return rows


def _bin_grids(c: GroupClaims) -> list[Block]:
    """Where the first scorer other than the engine's own prefill differs: along the
    sequence and by the scorer's top-1/top-2 gap."""
    for scorer, s in _ordered(c.scorers):
        if scorer == OWN_PREFILL and len(c.scorers) > 1:
            continue
        return [
            Grid(
                (f"{scorer}: position (eighth)", "tokens", "mean |delta|", "large"),
                [(str(b.eighth), str(b.tokens), number(b.abs_logp_mean), str(b.large))
                 for b in s.by_position],
            ),
            Grid(
                (f"{scorer}: top-1/top-2 gap", "tokens", "mean |delta|", "large"),
                [(_gap(b.margin_from, b.margin_to), str(b.tokens), number(b.abs_logp_mean),
                  str(b.large)) for b in s.by_margin],
            ),
        ]  # fmt: skip
    return []


def _metric(metrics: dict[str, float | None], name: str) -> str:
    return count(metrics[name]) if name in COUNTS else number(metrics[name])


def _gap(low: float, high: float | None) -> str:
    return f"[{low:g}, {high:g})" if high is not None else f">= {low:g}"


def _term_row(chain: str, name: str, term: Term) -> tuple[str, ...]:
    return (
        chain,
        name,
        f"{number(term.mean)}{_ci(term.ci95)}",
        f"{number(term.abs_mean)}{_ci(term.abs_ci95)}",
        number(term.max_abs),
        str(term.tokens_moved),
    )


ROLLOUT_SECTION = Section(
    "rollout",
    (ROLLOUT_TABLE,),
    RolloutClaims,
    rollout_claims,
    lambda claims: summary_lines(claims.precisions),
    report=_report,
)
