"""The report's sections: the blocks each part of a run's claims and ledgers becomes
(run facts, the headline beside the paper, the matrix, transplants, a serving engine,
resample, the flip predictor), put in reading order by report_blocks, before any
rendering."""

from __future__ import annotations

import json
from pathlib import Path

from kvreplay.analysis.claims import Json, fraction, matrix_blocks, rate_text, transplant_panels
from kvreplay.analysis.flip import (
    AUDIT_SHARE,
    PRIMARY_SCORE,
    SCORES,
    FlipAnalysis,
    analyze_flip,
)
from kvreplay.analysis.ledgers import RESAMPLE_FILE, SERVED_CONTROLS, Ledger, LedgerError
from kvreplay.jsonio import parse_json
from kvreplay.report.document import Block, Heading, Image, Paragraph, Table
from kvreplay.report.figures import (
    figure_accuracy,
    figure_disagreement,
    figure_first_divergence,
    figure_layer_drift,
    figure_resample,
    figure_roc,
    figure_transplant,
)
from kvreplay.report.vocabulary import ENDPOINTS, TRANSPLANT_RATES

# The paper's published headline figures (the paper's method, last section), as reference numbers.
PAPER_BF16_RATES = {
    "suffix_disagreement": (166, 200),
    "answer_disagreement": (49, 200),
    "correctness_label_disagreement": (20, 200),
}
PAPER_BF16_ACCURACY = (93, 95, 200)
PAPER_BF16_DELTA_PP = (1.0, -3.5, 5.5)
PAPER_REPLICAS_EXACT = (200, 200)
PAPER_FP32_DIFFERING = (0, 200)
PAPER_FP32_WILSON_UPPER = 0.0188
PAPER_BRIDGE_EXACT = (12, 12)
PAPER_TRANSPLANT = {"primary": ((24, 24), (0, 8)), "later": ((43, 43), (0, 5))}


def _interval(low: float, high: float) -> str:
    return f"[{low:+.1f}, {high:+.1f}]"


def _percent_interval(payload: Json) -> str:
    low, high = payload["wilson_95_ci"]
    return f"{100 * payload['rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def _headline_rows(claims: Json) -> list[tuple[str, ...]]:
    """Rows of the headline table: claim, this run, the paper's published figure."""
    rows: list[tuple[str, ...]] = []
    for design, precision, block in matrix_blocks(claims):
        label = f"{design.section} {precision}"
        if precision == "fp32":
            differing = [block[key] for key in PAPER_BF16_RATES]
            upper = max(payload["wilson_95_ci"][1] for payload in differing)
            rows.append(
                (
                    f"{label}: suffixes / answers / labels differing",
                    ", ".join(rate_text(p) for p in differing) + f" (Wilson upper {upper:.2%})",
                    f"{fraction(*PAPER_FP32_DIFFERING)} on every endpoint"
                    f" (Wilson upper {PAPER_FP32_WILSON_UPPER:.2%})",
                )
            )
            continue
        paper = precision == "bf16"
        for key, (count, n) in PAPER_BF16_RATES.items():
            name = key.removesuffix("_disagreement").replace("_", " ")
            rows.append(
                (
                    f"{label}: {name} differs",
                    rate_text(block[key]),
                    fraction(count, n) if paper else "—",
                )
            )
        left_correct, prefill_correct = block[f"{design.left}_correct"], block["prefill_correct"]
        rows.append(
            (
                f"{label}: correct, {design.left} vs prefill",
                f"{left_correct} vs {prefill_correct} of {block['rows']}",
                "{} vs {} of {}".format(*PAPER_BF16_ACCURACY) if paper else "—",
            )
        )
        delta, (low, high) = (
            block["accuracy_delta_prefill_minus_left_pp"],
            block["accuracy_paired_bootstrap_95_ci_pp"],
        )
        paper_delta, paper_low, paper_high = PAPER_BF16_DELTA_PP
        rows.append(
            (
                f"{label}: accuracy change, prefill − {design.left} (bootstrap 95% CI)",
                f"{delta:+.1f} pp {_interval(low, high)}",
                f"{paper_delta:+.1f} pp {_interval(paper_low, paper_high)}" if paper else "—",
            )
        )
        rows.append(
            (
                f"{label}: replicas exact, {design.left} / prefill",
                f"{fraction(block[f'{design.left}_replica_exact_rows'], block['rows'])}, "
                f"{fraction(block['prefill_replica_exact_rows'], block['rows'])}",
                f"{fraction(*PAPER_REPLICAS_EXACT)} on both arms" if paper else "—",
            )
        )
    if bridge := claims.get("prospective_bridge"):
        rows.append(
            (
                "prospective bridge: live vs teacher-forced, suffix exact",
                fraction(bridge["live_teacher_suffix_exact_rows"], bridge["rows"]),
                fraction(*PAPER_BRIDGE_EXACT),
            )
        )
    for name, block in transplant_panels(claims):
        recovery, controls = PAPER_TRANSPLANT.get(name, (None, None))
        rows.append(
            (
                f"transplant {name}: donor recovered both ways",
                rate_text(block["bidirectional_donor_recovery"]),
                fraction(*recovery) if recovery else "—",
            )
        )
        rows.append(
            (
                f"transplant {name}: exact controls changed",
                rate_text(block["exact_control_novel_trajectory"]),
                fraction(*controls) if controls else "—",
            )
        )
    return rows


FLIP_METHOD_NOTE = (
    "Flip predictor (beyond the paper). Each row gets a risk score from the left arm's"
    " trajectory alone, known before any prefill is built: the top-1 minus top-2 logit"
    " margin of every decoded suffix step (the live arm of `matched`; the replay arm of"
    " `fixed-prefix`, bit-exact with live). A greedy suffix can only change where a"
    " rebuilt state moves the logits past such a margin. Scores, fixed in advance and all"
    " reported: {scores}; `{primary}` was named primary before any run was scored. The"
    " label is suffix divergence (`suffix_equal` false). AUC is the Mann-Whitney"
    " probability that a divergent row outranks an exact one, ties counted half; it is"
    " undefined when a precision has no divergent or no exact row. The audit takes the"
    " riskiest ceil({share:.0%} of n) rows, equal risks in ascending row id; because BF16"
    " margins are often exactly 0, many rows tie at the cut, so the catch expected under a"
    " random order of the tied rows is shown beside it, and a random audit would catch"
    " about {share:.0%}. Intervals: percentile row bootstrap, 20,000 seeded resamples,"
    " resamples without both classes dropped."
)


def _flip_rows(flip: FlipAnalysis) -> list[tuple[str, ...]]:
    rows = []
    for panel in flip.panels:
        if panel.undefined:
            undefined = f"undefined: {panel.undefined}"
            head = (
                panel.section,
                panel.precision,
                "every score",
                f"{panel.divergent}/{panel.rows}",
            )
            rows.append((*head, undefined, str(panel.results[0].catch.audited), "—", "—"))
            continue
        for result in panel.results:
            auc, catch = result.auc, result.catch
            if auc is None or result.auc_ci is None:
                auc_text = "undefined"
            else:
                auc_text = f"{auc:.3f} [{result.auc_ci.low:.3f}, {result.auc_ci.high:.3f}]"
            if catch.share is None or result.catch_ci is None:
                caught = expected = "undefined (no row diverges)"
            else:
                low, high = 100 * result.catch_ci.low, 100 * result.catch_ci.high
                share = f"{100 * catch.share:.0f}% [{low:.0f}, {high:.0f}]"
                caught = f"{catch.caught}/{catch.divergent} ({share})"
                expected = f"{100 * catch.expected_if_ties_random / catch.divergent:.0f}%"
            rows.append(
                (
                    panel.section,
                    panel.precision,
                    result.score.name,
                    f"{panel.divergent}/{panel.rows}",
                    auc_text,
                    f"{catch.audited} ({catch.tied_at_cut} tied at cut)",
                    caught,
                    expected,
                )
            )
    return rows


def _flip_blocks(run_dir: Path, ledgers: dict[str, Ledger], figures: Path) -> list[Block]:
    """The flip predictor's table, ROC figure and method note; a plain note when skipped."""
    flip = analyze_flip(run_dir, ledgers)
    blocks: list[Block] = [Heading("Flip predictor: which rows will a rebuilt prefix change?")]
    if flip.skipped:
        return [*blocks, Paragraph(flip.skipped)]
    scores = "; ".join(f"`{s.name}` = {s.description}" for s in SCORES)
    blocks += [
        Paragraph(FLIP_METHOD_NOTE.format(scores=scores, primary=PRIMARY_SCORE, share=AUDIT_SHARE)),
        Table(
            (
                "section",
                "precision",
                "score",
                "divergent/rows",
                "AUC [bootstrap 95% CI]",
                "audited rows",
                "divergent caught [95% CI, %]",
                "caught if ties random",
            ),
            _flip_rows(flip),
        ),
    ]
    if figure := figure_roc(flip, figures / "flip_predictor_roc.png"):
        blocks.append(
            Image(figure, "ROC of each margin score against suffix divergence; dashed: not bf16.")
        )
    else:
        blocks.append(Paragraph("No precision has both divergent and exact rows, so no ROC."))
    return blocks


RESAMPLE_METHOD_NOTE = (
    "Method. Each seed drove one sample from the live state and one from the prefill state"
    " of the same prefix, so seeds are paired; items are fixed and seeds are the random"
    " draws; alpha = 0.05. Paired: the share of seeds whose tokens changed (Wilson 95%)"
    " and exact McNemar on per-seed correctness. Accuracy change (prefill − live): mean"
    " over items, its standard error with half a pair added to each cell of every item's"
    " 2x2 table, equivalent (TOST) when the 90% interval lies inside ±margin. TV distance"
    " between the answer distributions (unparsed answers are one category): mean over"
    " items, percentile bootstrap of seed pairs within items (2,000 seeded resamples), and"
    " a permutation test that swaps each pair's answers. Its TOST upper bound is the"
    " smaller of a coupling bound (a seed's two samples share a random stream, so TV is at"
    " most the share of pairs whose answers differ: Wilson upper bound) and the bootstrap's"
    " upper percentile (used once 10 pairs' answers differ), each at alpha/2. Faithful:"
    " both TOSTs pass. Not faithful: the accuracy interval lies outside the margin, or the"
    " permutation test rejects equality and the TV interval lies above the margin."
    " Otherwise undecided, with the samples per item that would decide at power 0.8,"
    " projecting each bound with 1/sqrt(K) at the measured spread; a TV refutation is"
    " projected from the TV in excess of the permutation mean (the TV that equal"
    " distributions give at this K, far above zero for a wide answer distribution). The"
    " power table gives those samples per item for other margins."
)


def _estimate(value: float, interval: list[float], spec: str) -> str:
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _resample_rows(section: Json) -> list[tuple[str, ...]]:
    rows = []
    for precision, b in section.items():
        changed, tv, accuracy = (
            b["seeds_changed"],
            b["tv_distance"],
            b["accuracy_difference_prefill_minus_live"],
        )
        rows.append(
            (
                precision,
                f"{b['temperature']:g} / {b['top_p']:g}",
                f"{b['items']} × {b['samples_per_item']}",
                f"{changed['count']}/{changed['n']} {_percent_interval(changed)}",
                str(b["answers_changed"]),
                f"{b['mcnemar']['exact_two_sided_p']:.3g}",
                _estimate(accuracy["estimate"], accuracy["tost_90_ci"], "+.3f"),
                _estimate(tv["estimate"], tv["bootstrap_95_ci"], ".3f"),
                f"{tv['equal_distributions_mean']:.3f}",
                f"{tv['tost_upper_bound']:.3f}",
                f"{tv['permutation_p']:.3g}",
                b["verdict"],
            )
        )
    return rows


def _resample_blocks(claims: Json, ledgers: dict[str, Ledger], figures: Path) -> list[Block]:
    """The certificate first, one sentence per precision; then its evidence and method."""
    section = claims.get("resample")
    if not section or RESAMPLE_FILE not in ledgers:
        return []
    blocks: list[Block] = [Heading("Resample: is resampling from a rebuilt prefix faithful?")]
    blocks += [Paragraph(f"{precision}: {b['sentence']}") for precision, b in section.items()]
    blocks += [
        Table(
            (
                "precision",
                "temperature / top-p",
                "items × samples",
                "seeds changed [95% CI, %]",
                "answers changed",
                "McNemar p",
                "accuracy change [90% CI]",
                "TV [95% CI]",
                "TV if equal distributions",
                "TV upper bound",
                "permutation p",
                "verdict",
            ),
            _resample_rows(section),
        ),  # fmt: skip
        Paragraph(RESAMPLE_METHOD_NOTE),
        Table(
            ("precision", "margin", "samples per item: accuracy", "TV", "faithful verdict"),
            [
                (
                    precision,
                    f"{entry['margin']:g}",
                    *(
                        str(entry["samples_per_item"][k] or "—")
                        for k in ("accuracy", "tv", "faithful")
                    ),
                )
                for precision, b in section.items()
                for entry in b["power"]
            ],
        ),  # fmt: skip
    ]
    ledger = ledgers[RESAMPLE_FILE]
    for precision, b in section.items():
        rows = ledger.select(ledger["precision"] == precision)
        figure = figure_resample(rows, b, precision, figures / f"resample_{precision}.png")
        blocks.append(
            Image(figure, f"{precision}: answer counts per item, live vs prefill; pooled TV.")
        )
    return blocks


def _manifest_rows(run_dir: Path) -> list[tuple[str, ...]]:
    """The facts a reader needs to judge a run: model, precision contract, machine, items."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return []
    try:
        manifest = parse_json(path.read_bytes())
        contract = manifest["contract"]
        model, env, run = contract["model_info"], contract["environment"], contract["run"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LedgerError("manifest.json", f"it is not a kvreplay run manifest ({error})") from None
    engines = {
        name: entry.get("engine", {}).get("engine", "?")
        for name, entry in manifest.get("experiments", {}).items()
    }
    return [
        ("model", f"{model['spec']} ({model['model_type']}, {model['num_layers']} layers)"),
        ("model digest", model["model_digest"]),
        ("stage plan", run["plan"]["name"] + ", boundary after " + run["plan"]["boundary_stage"]),
        (
            "items",
            f"{contract['items']['source']} ({contract['items']['count']} items, "
            f"digest {contract['items']['digest'][:16]}…)",
        ),
        ("device", f"{env['device']} ({env['device_name']}), {env['threads']} threads"),
        (
            "versions",
            f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}",
        ),
        ("dtype contract", json.dumps(env["dtype_contract"], sort_keys=True)),
        *(
            [
                (
                    "backend",
                    f"{run['backend']['name']} {env.get(run['backend']['name'], '?')}, "
                    + json.dumps(run["backend"], sort_keys=True),
                )
            ]
            if "backend" in run
            else []
        ),
        ("experiments", ", ".join(f"{k} ({v})" for k, v in engines.items())),
        ("kvreplay", f"{manifest.get('kvreplay_version')} at {manifest.get('git_commit') or '?'}"),
    ]


def report_blocks(
    run_dir: Path, claims: Json, ledgers: dict[str, Ledger], figures: Path
) -> list[Block]:
    """The report's content, independent of its Markdown or HTML rendering."""
    blocks: list[Block] = [Heading(f"kvreplay report: {run_dir.resolve().name}")]
    manifest = _manifest_rows(run_dir)
    blocks.append(Heading("Run"))
    if manifest:
        blocks.append(Table(("field", "value"), manifest))
    else:
        blocks.append(Paragraph("No manifest.json here, so model, engine and device are unknown."))
    blocks.append(Paragraph("Ledgers read: " + ", ".join(sorted(ledgers)) + "."))

    blocks += [
        Heading("Headline, beside the paper"),
        Paragraph(
            "The paper column quotes the stage-replay paper's published figures"
            " (arXiv 2607.28495); a run on another model or item set is not expected to match."
        ),
        Table(("claim", "this run", "paper"), _headline_rows(claims)),
    ]

    matrix = list(matrix_blocks(claims))
    if matrix:
        blocks += [
            Heading("Disagreement rates (Wilson 95% intervals)"),
            Table(
                ("section", "precision", "endpoint", "count/n", "rate [95% CI, %]"),
                [
                    (d.section, p, label, rate_text(b[key]), _percent_interval(b[key]))
                    for d, p, b in matrix
                    for key, label in ENDPOINTS
                ],
            ),
        ]
        if figure := figure_disagreement(claims, figures / "disagreement_rates.png"):
            blocks.append(
                Image(figure, "Rows where prefill and the left arm disagree, by endpoint.")
            )
        extra = claims.get("extra", {})
        blocks += [
            Heading("Accuracy per arm"),
            Table(
                (
                    "section",
                    "precision",
                    "left correct",
                    "prefill correct",
                    "change (pp)",
                    "bootstrap 95% CI",
                    "Newcombe 95% CI",
                    "McNemar p",
                ),
                [
                    (
                        d.section,
                        p,
                        fraction(b[f"{d.left}_correct"], b["rows"]),
                        fraction(b["prefill_correct"], b["rows"]),
                        f"{b['accuracy_delta_prefill_minus_left_pp']:+.1f}",
                        _interval(*b["accuracy_paired_bootstrap_95_ci_pp"]),
                        _interval(*newcombe)
                        if (
                            newcombe := extra.get(d.section, {})
                            .get(p, {})
                            .get("accuracy_delta_prefill_minus_left", {})
                            .get("newcombe_method10_95_ci_pp")
                        )
                        else "—",
                        f"{b['mcnemar_exact_two_sided_p']:.3g}",
                    )
                    for d, p, b in matrix
                ],
            ),
        ]
        if figure := figure_accuracy(claims, figures / "accuracy.png"):
            blocks.append(
                Image(
                    figure,
                    "Accuracy of each arm; prefill minus left with its paired bootstrap interval.",
                )
            )
        blocks.append(Heading("Where suffixes first diverge"))
        if figure := figure_first_divergence(ledgers, figures / "first_divergence.png"):
            blocks.append(
                Image(figure, "First differing suffix token, over rows whose suffixes differ.")
            )
        else:
            blocks.append(Paragraph("No suffix diverged, so there is no histogram."))
        blocks.append(Heading("Cache drift by layer"))
        figure, note = figure_layer_drift(ledgers, figures / "cache_drift_by_layer.png")
        blocks.append(Image(figure, note) if figure else Paragraph(note))

    transplants = list(transplant_panels(claims))
    if transplants:
        blocks += [
            Heading("Transplant recovery"),
            Table(
                ("panel", *(label for _, label in TRANSPLANT_RATES)),
                [
                    (name, *(rate_text(b[key]) for key, _ in TRANSPLANT_RATES))
                    for name, b in transplants
                ],
            ),
        ]
        if figure := figure_transplant(claims, figures / "transplant_recovery.png"):
            blocks.append(
                Image(
                    figure, "Donor recovery after swapping all K/V layers (Wilson 95% intervals)."
                )
            )
    blocks += _served_blocks(claims)
    blocks += _resample_blocks(claims, ledgers, figures)
    if matrix:
        blocks += _flip_blocks(run_dir, ledgers, figures)
    return blocks


SERVED_NOTE = (
    "These rows come from a serving engine, which exposes token ids and top-k logprobs but "
    "no K/V tensors. In the matched tables above, 'live' is a prefix-cache hit (the blocks "
    "of P written by the generation that reached P, prompt prefill and decode steps, reused; "
    "only the tail recomputed) and 'prefill' a miss (the cache reset, P prefilled in one "
    "shot); the integrity gate checks that every hit read all the full blocks its rewrite "
    "of P wrote and every miss none. A row can show whether the two continue differently, "
    "where, with what top-1/top-2 margin, and how many tokens the hit reused; it cannot "
    "show how the cached K/V differ, so the cache-exactness, drift and storage columns are "
    "empty and no transplant, bridge or localisation runs on this backend."
)


def _served_blocks(claims: Json) -> list[Block]:
    """What a served run adds: its controls and how much of P the hit reused."""
    section = claims.get("served_matched")
    if not section:
        return []
    rows = [
        (
            precision,
            f"{b['live_cached_tokens_median']:g} / {b['prefix_token_count_median']:g}",
            f"{b['prefill_cached_tokens_median']:g}",
            *(
                rate_text(b[key]) if b[key]["n"] else "—"
                for key in (c.replace("_equal_", "_differs_from_") for c in SERVED_CONTROLS)
            ),
        )
        for precision, b in section.items()
    ]
    return [
        Heading("Serving engine: prefix-cache hit vs miss"),
        Paragraph(SERVED_NOTE),
        Table(
            (
                "precision",
                "hit cached tokens / P (median)",
                "miss cached tokens (median)",
                *(f"{label}: suffixes differ" for label in SERVED_CONTROLS.values()),
            ),
            rows,
        ),
    ]
