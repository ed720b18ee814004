"""Turn a folder of validated ledgers into a claims JSON in the paper's schema.

Each section carries exactly the keys of the paper's claims skeleton, computed
as the paper's published method specifies, so a user's run and the paper's published ledgers can
be compared number for number. Anything beyond the paper lives under `extra`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvreplay.analysis.certificate import PairedSamples, certify
from kvreplay.analysis.flip import analyze_flip, flip_summary_lines
from kvreplay.analysis.ledgers import (
    BRIDGE_FILE,
    FIXED_FILE,
    HISTORICAL_FILE,
    HISTORICAL_FLAG_COLUMNS,
    HISTORICAL_LEAF_COLUMNS,
    MATCHED_FILE,
    RESAMPLE_FILE,
    SERVED_CONTROLS,
    STOCK_FILE,
    TRANSPLANT_FILE,
    TRANSPLANT_RECOVERY,
    Ledger,
    load_ledger_dir,
)
from kvreplay.analysis.stats import (
    MATRIX_WILSON_Z,
    TRANSPLANT_WILSON_Z,
    mcnemar_exact_p,
    newcombe_paired_difference_ci,
    paired_bootstrap_ci_pp,
    wilson_interval,
)

SCHEMA = "stage-replay-paper-claims-v1"
PRECISION_STREAM_OFFSET = {"bf16": 0, "fp32": 1}
CROSS_PRECISION_STREAMS = {
    "suffix_mismatch": 20,
    "answer_mismatch": 21,
    "correctness_flip": 22,
    "logits_mismatch": 23,
}
ACCURACY_DIFFERENCE_STREAM = 30
NEWCOMBE_NOTE = (
    "Newcombe (1998) method 10 score interval for a paired difference of proportions"
    " (z = 1.96), in percentage points, beside the paper's paired percentile bootstrap."
)
Json = dict[str, Any]


@dataclass(frozen=True)
class MatrixDesign:
    """What distinguishes the matched and fixed-prefix matrices: left arm, streams, extras."""

    file: str
    section: str
    left: str
    stream_base: int
    cross_precision_endpoints: bool


MATRIX_DESIGNS = (
    MatrixDesign(MATCHED_FILE, "matched_live_prefill", "live", 0, False),
    MatrixDesign(FIXED_FILE, "fixed_prefix_2x2", "incremental", 100, True),
)


def _count(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


def rate_payload(count: int, n: int, z: float) -> Json:
    """The paper's rate object: count, n, rate and a clipped Wilson interval."""
    return {
        "count": count,
        "n": n,
        "rate": count / n if n else 0.0,
        "wilson_95_ci": list(wilson_interval(count, n, z)),
    }


def _median(values: np.ndarray) -> float:
    return float(np.median(values))


def _correctness_delta(rows: Ledger, left: str) -> np.ndarray:
    """d = prefill_correct - left_correct per row, in {-1, 0, 1}."""
    return rows["prefill_correct"].astype(np.int64) - rows[f"{left}_correct"].astype(np.int64)


def _endpoint_vectors(rows: Ledger, left: str) -> dict[str, np.ndarray]:
    """Per-row 0/1 mismatch vectors compared across precisions."""
    return {
        "suffix_mismatch": ~rows["suffix_equal"],
        "answer_mismatch": ~rows["answer_equal"],
        "correctness_flip": _correctness_delta(rows, left) != 0,
        "logits_mismatch": ~rows[f"{left}_prefill_logits_exact"],
    }


def _first_divergence(rows: Ledger) -> Json:
    indices = rows["first_suffix_divergence_index"]
    indices = indices[~np.isnan(indices)]
    if not indices.size:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {
        "n": int(indices.size),
        "min": int(indices.min()),
        "median": _median(indices),
        "max": int(indices.max()),
    }


def _difference_payload(first: np.ndarray, second: np.ndarray, stream: int) -> Json:
    """Paper's bootstrap beside Newcombe for mean(first - second), in points."""
    difference = first.astype(np.int64) - second.astype(np.int64)
    low, high = newcombe_paired_difference_ci(first, second)
    return {
        "estimate_pp": float(difference.mean() * 100),
        "paired_bootstrap_95_ci_pp": list(paired_bootstrap_ci_pp(difference, stream)),
        "newcombe_method10_95_ci_pp": [low * 100, high * 100],
    }


def _precision_block(rows: Ledger, left: str, stream: int) -> tuple[Json, Json]:
    """Claims for one precision of a matrix file, plus its Newcombe extra."""
    n = len(rows)
    d = _correctness_delta(rows, left)
    left_only, prefill_only = _count(d == -1), _count(d == 1)
    accuracy = _difference_payload(rows["prefill_correct"], rows[f"{left}_correct"], stream)
    block: Json = {
        "rows": n,
        **{
            f"{arm}_replica_exact_rows": _count(
                np.logical_and.reduce(
                    [
                        rows[f"{arm}_replica_{part}_exact"]
                        for part in ("cache", "logits", "suffix")
                        if f"{arm}_replica_{part}_exact" in rows
                    ]  # fmt: skip
                )
            )
            for arm in (left, "prefill")
        },
        # a served ledger (no K/V access) has no cache, state or storage columns
        **{
            f"{column}_rows": _count(rows[column])
            for column in ("functional_state_equal", "all_storage_disjoint")
            if column in rows
        },
        "integrity_pass_rows": _count(rows["integrity_pass"]),
        **(
            {"cache_exact_rows": _count(rows[f"{left}_prefill_cache_exact"])}
            if f"{left}_prefill_cache_exact" in rows
            else {}
        ),
        "logits_exact_rows": _count(rows[f"{left}_prefill_logits_exact"]),
        **{
            f"{column}_median": _median(rows[column])
            for column in (
                "cache_max_abs_diff",
                "cache_mean_abs_diff",
                "logit_max_abs_diff",
                "logit_mean_abs_diff",
                "cache_relative_l2_diff",
            )
            if column in rows
        },
        "immediate_argmax_different_rows": _count(~rows["boundary_argmax_equal"]),
        **{
            f"{endpoint}_disagreement": rate_payload(
                _count(~rows[f"{endpoint}_equal"]), n, MATRIX_WILSON_Z
            )
            for endpoint in ("suffix", "trace", "merge", "answer")
        },
        "first_divergence": _first_divergence(rows),
        "first_token_divergence_rows": _count(rows["first_suffix_divergence_index"] == 0),
        f"{left}_correct": _count(rows[f"{left}_correct"]),
        "prefill_correct": _count(rows["prefill_correct"]),
        f"{left}_only_correct": left_only,
        "prefill_only_correct": prefill_only,
        "accuracy_delta_prefill_minus_left_pp": accuracy["estimate_pp"],
        "accuracy_paired_bootstrap_95_ci_pp": accuracy["paired_bootstrap_95_ci_pp"],
        "correctness_label_disagreement": rate_payload(_count(d != 0), n, MATRIX_WILSON_Z),
        "mcnemar_exact_two_sided_p": mcnemar_exact_p(left_only, prefill_only),
    }
    extra = {"accuracy_delta_prefill_minus_left": accuracy}
    return block, extra


def _cross_precision(bf16: Ledger, fp32: Ledger, left: str) -> tuple[Json, Json]:
    """FP32-minus-BF16 effects on rows paired by order (fixed-prefix file only)."""
    section: Json = {}
    extra: Json = {}
    low_endpoints, high_endpoints = _endpoint_vectors(bf16, left), _endpoint_vectors(fp32, left)
    for endpoint, stream in CROSS_PRECISION_STREAMS.items():
        low, high = low_endpoints[endpoint], high_endpoints[endpoint]
        payload = _difference_payload(high, low, stream)
        e = high.astype(np.int64) - low.astype(np.int64)
        bf16_only, fp32_only = _count(e == -1), _count(e == 1)
        section[endpoint] = {
            "bf16_count": _count(low),
            "fp32_count": _count(high),
            "delta_fp32_minus_bf16_pp": payload["estimate_pp"],
            "paired_bootstrap_95_ci_pp": payload["paired_bootstrap_95_ci_pp"],
            "bf16_only": bf16_only,
            "fp32_only": fp32_only,
            "mcnemar_exact_two_sided_p": mcnemar_exact_p(bf16_only, fp32_only),
        }
        extra[endpoint] = payload
    effect = _correctness_delta(fp32, left) - _correctness_delta(bf16, left)
    section["accuracy_effect_difference"] = {
        "delta_fp32_minus_bf16_pp": float(effect.mean() * 100),
        "paired_bootstrap_95_ci_pp": list(
            paired_bootstrap_ci_pp(effect, ACCURACY_DIFFERENCE_STREAM)
        ),
    }
    return section, extra


def _precision_streams(precisions: list[str], base: int) -> dict[str, int]:
    """bf16 and fp32 use the paper's streams; any other precision follows, in sorted order."""
    others = sorted(p for p in precisions if p not in PRECISION_STREAM_OFFSET)
    offsets = {**PRECISION_STREAM_OFFSET, **{p: 2 + i for i, p in enumerate(others)}}
    return {p: base + offsets[p] for p in precisions}


def matrix_section(ledger: Ledger, design: MatrixDesign) -> tuple[Json, Json]:
    """Claims and extras of a matched or fixed-prefix matrix, for whatever precisions it holds."""
    precisions = list(dict.fromkeys(ledger["precision"].tolist()))
    by_precision = {p: ledger.select(ledger["precision"] == p) for p in precisions}
    section: Json = {}
    extra: Json = {}
    for precision, stream in _precision_streams(precisions, design.stream_base).items():
        section[precision], extra[precision] = _precision_block(
            by_precision[precision], design.left, stream
        )
    if "bf16" in by_precision and "fp32" in by_precision:
        bf16, fp32 = by_precision["bf16"], by_precision["fp32"]
        section["cross_precision_prefix_exact_rows"] = _count(
            (bf16["prefix_sha256"] == fp32["prefix_sha256"])
            & (bf16["prefix_token_count"] == fp32["prefix_token_count"])
        )
        if design.cross_precision_endpoints:
            section["cross_precision"], extra["cross_precision"] = _cross_precision(
                bf16, fp32, design.left
            )
    return section, extra


def prospective_bridge_section(ledger: Ledger) -> Json:
    """Live cache vs teacher-forced rebuild on newly reached prefixes."""
    return {
        "rows": len(ledger),
        **{
            f"{column}_rows": _count(ledger[column])
            for column in (
                "integrity_pass",
                "live_matches_historical_prefix",
                "live_teacher_cache_exact",
                "live_teacher_logits_exact",
                "live_teacher_suffix_exact",
                "all_48_layers_exact",
            )
        },
        **{
            f"{kind}_prefix_length_range": [
                int(ledger[f"{kind}_prefix_token_count"].min()),
                int(ledger[f"{kind}_prefix_token_count"].max()),
            ]
            for kind in ("new", "historical")
        },
    }


def historical_bridge_section(ledger: Ledger) -> Json:
    """Counts of every equality flag of the historical join, plus its schema leaf counts."""
    return {
        "rows": len(ledger),
        **{f"{column}_rows": _count(ledger[column]) for column in HISTORICAL_FLAG_COLUMNS},
        **{column: int(ledger[column][0]) for column in HISTORICAL_LEAF_COLUMNS},
    }


def transplant_section(ledger: Ledger) -> Json:
    """Donor recovery over divergent rows and novel trajectories over exact controls."""
    z = TRANSPLANT_WILSON_Z
    divergent = ledger["baseline_divergent"]
    exact = ~divergent
    n_divergent, n_exact = _count(divergent), _count(exact)
    recovery_flags = {
        flag.removesuffix("_recovers_donor") + "_donor_recovery": ledger[flag]
        for flag in TRANSPLANT_RECOVERY
    }
    recovery_flags["bidirectional_donor_recovery"] = ledger["bidirectional_donor_recovery"]
    return {
        "rows": len(ledger),
        "integrity_pass_rows": _count(ledger["integrity_pass"]),
        "baseline_divergence": rate_payload(n_divergent, len(ledger), z),
        "baseline_exact_rows": n_exact,
        **{
            key: rate_payload(_count(flag & divergent), n_divergent, z)
            for key, flag in recovery_flags.items()
        },
        "exact_control_novel_trajectory": rate_payload(
            _count(ledger["exact_control_novel_trajectory"] & exact), n_exact, z
        ),
    }


STOCK_COLUMNS = {
    "pair_replica_token_exact_rows": "pair_replica_tokens_exact",
    "pair_replica_logprob_exact_rows": "pair_replica_logprobs_exact",
    "singleton_pair_token_exact_rows": "singleton_pair_tokens_exact",
    "singleton_pair_logprob_exact_rows": "singleton_pair_logprobs_exact",
}


def stock_section(ledger: Ledger) -> Json:
    """Batch-composition control on a public checkpoint: exactness counts only."""
    return {
        "rows": len(ledger),
        **{key: _count(ledger[column]) for key, column in STOCK_COLUMNS.items()},
    }


def paired_samples(rows: Ledger) -> list[PairedSamples]:
    """Each resample row's seeds as the certificate's paired samples."""
    return [
        PairedSamples(
            item=str(rows.row_ids[i]),
            live=tuple(rows["live_answers"][i]),
            prefill=tuple(rows["prefill_answers"][i]),
            live_correct=tuple(rows["live_correct"][i]),
            prefill_correct=tuple(rows["prefill_correct"][i]),
            changed=tuple(index is not None for index in rows["first_divergence_indices"][i]),
        )
        for i in range(len(rows))
    ]


def resample_section(ledger: Ledger) -> Json:
    """The resample certificate of each precision, pooled over its items and per item."""
    margin = float(ledger["margin"][0])
    section: Json = {}
    for precision in dict.fromkeys(ledger["precision"].tolist()):
        rows = ledger.select(ledger["precision"] == precision)
        items = paired_samples(rows)
        section[precision] = {
            **certify(items, margin).to_json(),
            "temperature": float(rows["temperature"][0]),
            "top_p": float(rows["top_p"][0]),
            "per_item": {item.item: certify([item], margin).to_json() for item in items},
        }
    return section


def served_section(ledger: Ledger) -> Json:
    """A served matched ledger's own measures, per precision: how much of P the hit
    really reused, and how often each control continued differently."""
    section: Json = {}
    for precision in sorted(set(ledger["precision"].tolist())):
        rows = ledger.select(ledger["precision"] == precision)
        block: Json = {
            "backend": str(rows["backend"][0]),
            "rows": len(rows),
            "live_cached_tokens_median": _median(rows["live_cached_tokens"]),
            "prefill_cached_tokens_median": _median(rows["prefill_cached_tokens"]),
            "prefix_token_count_median": _median(rows["prefix_token_count"]),
        }
        for column, label in SERVED_CONTROLS.items():
            known = [v for v in rows[column] if v is not None]
            differ = sum(1 for v in known if not v)
            block[column.replace("_equal_", "_differs_from_")] = {
                "label": label,
                **rate_payload(differ, len(known), MATRIX_WILSON_Z),
            }
        section[precision] = block
    return section


def build_claims(ledgers: Mapping[str, Ledger]) -> Json:
    """Claims for every ledger given (keyed by file name); absent files leave no section."""
    claims: Json = {"schema": SCHEMA}
    extra: Json = {}
    for design in MATRIX_DESIGNS:
        if design.file in ledgers:
            claims[design.section], extra[design.section] = matrix_section(
                ledgers[design.file], design
            )
    if MATCHED_FILE in ledgers and "backend" in ledgers[MATCHED_FILE]:
        claims["served_matched"] = served_section(ledgers[MATCHED_FILE])
    if BRIDGE_FILE in ledgers:
        claims["prospective_bridge"] = prospective_bridge_section(ledgers[BRIDGE_FILE])
    if HISTORICAL_FILE in ledgers:
        claims["historical_bridge"] = historical_bridge_section(ledgers[HISTORICAL_FILE])
    if STOCK_FILE in ledgers:
        claims["stock_qwen_diagnostic"] = stock_section(ledgers[STOCK_FILE])
    if RESAMPLE_FILE in ledgers:
        claims["resample"] = resample_section(ledgers[RESAMPLE_FILE])
    for file_name, ledger in ledgers.items():
        if match := TRANSPLANT_FILE.fullmatch(file_name):
            claims[f"transplant_{match.group(1)}"] = transplant_section(ledger)
    if extra:
        claims["extra"] = {"note": NEWCOMBE_NOTE, **extra}
    return claims


def analyze_dir(folder: Path) -> Json:
    """Validate every known ledger in a folder and compute its claims, with the flip
    predictor (which needs rows.jsonl, not only the CSVs) under extra.flip_predictor."""
    ledgers = load_ledger_dir(folder)
    claims = build_claims(ledgers)
    if "extra" in claims:  # only matrix ledgers have rows to rank
        claims["extra"]["flip_predictor"] = analyze_flip(folder, ledgers).to_json()
    return claims


def write_claims(claims: Json, path: Path) -> None:
    """Sorted keys and a trailing newline, so reruns diff cleanly."""
    path.write_text(json.dumps(claims, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def fraction(count: int, n: int) -> str:
    return f"{count}/{n}"


def rate_text(payload: Json) -> str:
    """A rate payload as count/n: the exact numbers behind a percentage."""
    return fraction(payload["count"], payload["n"])


def transplant_panels(claims: Json) -> Iterator[tuple[str, Json]]:
    """Each transplant panel in the claims (section `transplant_<panel>`), by panel name."""
    for section, block in claims.items():
        if section.startswith("transplant_"):
            yield section.removeprefix("transplant_"), block


def matrix_blocks(claims: Json) -> Iterator[tuple[MatrixDesign, str, Json]]:
    """Every (design, precision, per-precision block) of the matrix sections in claims."""
    for design in MATRIX_DESIGNS:
        for precision, block in claims.get(design.section, {}).items():
            if isinstance(block, dict) and "rows" in block:
                yield design, precision, block


def summary_lines(claims: Json) -> list[str]:
    """One plain line per section with its headline numbers."""
    lines = []
    for design, precision, block in matrix_blocks(claims):
        low, high = block["accuracy_paired_bootstrap_95_ci_pp"]
        lines.append(
            f"{design.section} {precision}: suffixes differ"
            f" {rate_text(block['suffix_disagreement'])}, answers"
            f" {rate_text(block['answer_disagreement'])}, correctness labels"
            f" {rate_text(block['correctness_label_disagreement'])}; accuracy"
            f" {block[design.left + '_correct']} vs {block['prefill_correct']}"
            f" ({block['accuracy_delta_prefill_minus_left_pp']:+.1f} pp,"
            f" 95% CI [{low:+.1f}, {high:+.1f}])"
        )
    if bridge := claims.get("prospective_bridge"):
        lines.append(
            f"prospective_bridge: {bridge['live_teacher_suffix_exact_rows']}/{bridge['rows']}"
            f" suffixes exact, {bridge['all_48_layers_exact_rows']}/{bridge['rows']} caches"
            " exact in all layers"
        )
    if historical := claims.get("historical_bridge"):
        lines.append(
            f"historical_bridge: {historical['audit_pass_rows']}/{historical['rows']} audits pass"
        )
    for panel, block in transplant_panels(claims):
        lines.append(
            f"transplant_{panel}: donor recovered both ways on"
            f" {rate_text(block['bidirectional_donor_recovery'])} divergent rows;"
            f" exact controls changed {rate_text(block['exact_control_novel_trajectory'])}"
        )
    if stock := claims.get("stock_qwen_diagnostic"):
        lines.append(
            f"stock_qwen_diagnostic: singleton vs pair tokens exact"
            f" {stock['singleton_pair_token_exact_rows']}/{stock['rows']}"
        )
    for precision, block in claims.get("resample", {}).items():
        lines.append(f"resample {precision}: {block['sentence']}")
    return lines + flip_summary_lines(claims.get("extra", {}).get("flip_predictor"))
