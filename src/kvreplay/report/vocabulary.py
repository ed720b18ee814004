"""What the report's tables and figures both show of the claims: which rates, under
which labels."""

from __future__ import annotations

ENDPOINTS = (
    ("suffix_disagreement", "suffix"),
    ("trace_disagreement", "trace"),
    ("merge_disagreement", "merge"),
    ("answer_disagreement", "answer"),
    ("correctness_label_disagreement", "correctness label"),
)
TRANSPLANT_RATES = (
    ("baseline_divergence", "baseline divergent"),
    ("incremental_cache_into_prefill_donor_recovery", "replay cache → prefill"),
    ("prefill_cache_into_incremental_donor_recovery", "prefill cache → replay"),
    ("bidirectional_donor_recovery", "both ways"),
    ("exact_control_novel_trajectory", "exact control changed"),
)
