"""CSVs only the paper's release has (kvreplay reads them, no experiment writes them):
the historical bridge audit (``historical_bridge_audit.csv``) and the batch-composition
control on a stock checkpoint (``stock_qwen_control.csv``)."""

from __future__ import annotations

from kvreplay.harness.columns import Field, Kind
from kvreplay.harness.table import Table, check_same

HISTORICAL_LEAF_COLUMNS = (
    "cache_common_scalar_leaves_per_section",
    "logit_common_scalar_leaves_per_section",
)
HISTORICAL_FLAG_COLUMNS = (
    "prefix_commitment_equal",
    "live_incremental_suffix_equal",
    "live_replica_suffix_equal",
    "prefill_suffix_equal",
    "prefill_replica_suffix_equal",
    "comparison_objects_equal",
    *(
        f"{part}_{pair}_fingerprint_equal"
        for part in ("cache", "logits")
        for pair in ("live_replica", "live_prefill", "prefill_replica")
    ),
    "audit_pass",
)


def _fields(kind: Kind, *names: str) -> tuple[Field, ...]:
    return tuple(Field(name, kind) for name in names)


HISTORICAL_TABLE = Table(
    "historical_bridge_audit.csv",
    (
        *_fields("sha256", "source_live_row_sha256", "source_incremental_row_sha256"),
        *_fields("bool", *HISTORICAL_FLAG_COLUMNS),
        *_fields("int", *HISTORICAL_LEAF_COLUMNS),
    ),
    # leaf counts describe the schema, so a change across rows is a schema error
    checks=tuple(check_same(column) for column in HISTORICAL_LEAF_COLUMNS),
)
STOCK_TABLE = Table(
    "stock_qwen_control.csv",
    (
        Field("source_row_sha256", "sha256"),
        *_fields(
            "int",
            "selection_index",
            "input_token_count",
            "singleton_output_token_count",
            "paired_output_token_count",
        ),
        *_fields(
            "bool",
            "pair_replica_tokens_exact",
            "pair_replica_logprobs_exact",
            "singleton_pair_tokens_exact",
            "singleton_pair_logprobs_exact",
        ),
        *_fields("optional_int", "first_token_divergence_index", "first_logprob_divergence_index"),
        Field("max_abs_aligned_selected_token_logprob_difference", "float"),
    ),
)
