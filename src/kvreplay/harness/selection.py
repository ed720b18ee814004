"""Outcome-blind and outcome-stratified selection: which items an experiment runs, chosen
before any of its rows and recorded in the manifest.

``spread_selection`` takes order statistics of length (the bridge). A *panel* is chosen
from a prior run (``--from``): ``stratified`` takes its divergent rows and exact controls,
each stratum spread over prefix length (the paper's 24 + 8 at C0); ``blind`` spreads over
prefix length and identifier without looking at any outcome (the paper's C1
replication); ``divergent`` takes only divergent rows (``localize``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item, encode_prompt, items_digest
from kvreplay.core.options import COUNTS, SEEDS, bounds, option
from kvreplay.harness.declaration import Declaration
from kvreplay.harness.scope import Scope, Selection, own_options
from kvreplay.ledger import Record, RunLedger
from kvreplay.model.reading import load_tokenizer

PANELS = ("stratified", "blind")
BASIS = {
    "stratified": "prior_outcome_stratified_length_spread",
    "blind": "outcome_blind_length_and_identifier",
    "divergent": "prior_outcome_divergent_length_spread",
}
DEFAULT_DIVERGENT, DEFAULT_CONTROLS, DEFAULT_BLIND_N = 24, 8, 48


@dataclass(frozen=True)
class PanelOptions:
    """The own options of a panel experiment (``transplant``, ``localize``), typed."""

    panel: str = field(
        default="stratified",
        metadata=option(
            "--panel",
            "A prior run's divergent rows plus exact controls (stratified) or an "
            "outcome-blind length spread (blind).",
            choices=PANELS,
        ),
    )
    alias: str | None = field(
        default=None, metadata=option("--alias", "Checkpoint alias (e.g. C0).")
    )
    name: str | None = field(
        default=None,
        metadata=option(
            "--name",
            "Ledger kv_transplant_<name>.csv (default primary for stratified, later for blind).",
        ),
    )
    divergent: int | None = field(
        default=None,
        metadata=option(
            "--divergent",
            f"Divergent rows to take from --from (default {DEFAULT_DIVERGENT} for a "
            "stratified panel; every one for localize).",
            minimum=0,
            maximum=COUNTS[1],
        ),
    )
    controls: int = field(
        default=DEFAULT_CONTROLS,
        metadata=option(
            "--controls", "Exact control rows to take from --from.", minimum=0, maximum=COUNTS[1]
        ),
    )
    panel_seed: int = field(
        default=0,
        metadata=option(
            "--panel-seed", "Seed that orders equal-length rows in a panel.", **bounds(SEEDS)
        ),
    )
    both_directions: bool = field(
        default=False,
        metadata=option("--both-directions", "Also probe prefill K/V into the replay state."),
    )

    @classmethod
    def of(cls, scope: Scope) -> PanelOptions:
        return own_options(cls, scope, "a panel experiment")


def spread_selection(lengths: list[tuple[int, str]], n: int) -> list[str]:
    """Ids at evenly spaced order statistics of (length, id): outcome-blind by design."""
    ordered = sorted(lengths)
    if n >= len(ordered):
        return [item_id for _, item_id in ordered]
    if n == 1:
        return [ordered[len(ordered) // 2][1]]
    picks = sorted({round(i * (len(ordered) - 1) / (n - 1)) for i in range(n)})
    return [ordered[p][1] for p in picks]


def prompt_lengths(scope: Scope, items: list[Item]) -> dict[str, int]:
    """Token count of each item's prompt under the run's tokenizer and chat setting; a
    trajectory item (no prompt) counts its recorded prefix."""
    config = scope.config
    tokenizer = load_tokenizer(config.model, config.backend.trusts_remote_code)
    return {
        i.id: len(i.prefix_token_ids)
        if i.prefix_token_ids is not None
        else len(encode_prompt(tokenizer, i.prompt, config.chat))
        for i in items
    }


def _tiebreak(seed: int, item_id: str) -> str:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).hexdigest()[:16]


def spread(lengths: dict[str, int], n: int, seed: int) -> list[str]:
    """``n`` ids at evenly spaced order statistics of length; equal lengths are ordered
    by a seeded hash of the id, so the seed is the only freedom in the choice."""
    keyed = {f"{_tiebreak(seed, item_id)}:{item_id}": item_id for item_id in lengths}
    order = [(lengths[item_id], key) for key, item_id in keyed.items()]
    return [keyed[key] for key in spread_selection(order, n)]


def outcome_rows(
    rows: dict[str, Record], precision: str, sources: Sequence[Declaration]
) -> dict[str, Record]:
    """Per item, a completed two-arm row (left vs prefill) at ``precision``; earlier
    experiments in ``sources`` win."""
    found: dict[str, Record] = {}
    for source in reversed(sources):
        for record in rows.values():
            data = record.data
            if (
                record.experiment == source.name
                and data.get("precision") == precision
                and data.get("status") == "ok"
                and "arms" in data
            ):
                found[data["item_id"]] = record
    return found


def records_prefix(source: Declaration, data: dict[str, Any], prefix_dtype: str) -> bool:
    """Whether a completed row of ``source`` records a prefix a later panel may take: a
    row of the kind the source declares, else (none declared) one at the prefix precision."""
    if data.get("status") != "ok" or "prefix_token_ids" not in data:
        return False
    if source.prefix_kind is not None:
        return data.get("kind") == source.prefix_kind
    return data["precision"] == prefix_dtype


def prefix_rows(
    rows: dict[str, Record], prefix_dtype: str, sources: Sequence[Declaration]
) -> dict[str, Record]:
    """Per item, a recorded prefix from the first of ``sources`` (most preferred first)
    that has one, its first such row."""
    found: dict[str, Record] = {}
    for source in sources:
        for record in rows.values():
            if record.experiment == source.name and records_prefix(
                source, record.data, prefix_dtype
            ):
                found.setdefault(record.data["item_id"], record)
    return found


def diverges(record: Record) -> bool:
    """A prior two-arm row whose left and prefill suffixes differ (read from the suffix
    hashes alone, so rows of any run that recorded arms can seed a panel)."""
    arms = record.data["arms"]
    return arms["left"]["suffix_sha256"] != arms["prefill"]["suffix_sha256"]


def _source_contract(scope: Scope) -> str | None:
    """A source run's rows are its items': refuse another item set (its model was held
    to this run's when the run was read, ``runner._source_run``)."""
    if scope.source is None:
        return None
    path = scope.source.path
    contract = RunLedger.open_existing(path).manifest["contract"]
    recorded = contract.get("items")
    if not isinstance(recorded, dict) or recorded.get("digest") != items_digest(scope.items):
        raise KvreplayError(
            f"The source run {path} used another item set; pass --items {path / 'items.jsonl'}."
        )
    return scope.source.contract_hash


def _take(kind: str, available: dict[str, int], wanted: int, precision: str) -> None:
    if wanted < 0 or wanted > len(available):
        raise KvreplayError(
            f"The source run has {len(available)} {kind} {precision} rows "
            f"but the panel asks for {wanted}."
        )


def _entry(index: int, item_id: str, stratum: str, record: Record | None) -> dict[str, Any]:
    return {
        "selection_index": index,
        "item_id": item_id,
        "historical_stratum": stratum,
        "source_key": record.key if record else None,
        "source_row_sha256": record.row_sha256 if record else None,
        "prefix_token_count": record.data["prefix_token_count"] if record else None,
    }


def _blind_lengths(scope: Scope, prefixes: dict[str, Record]) -> tuple[dict[str, int], str]:
    if scope.source is not None:
        lengths = {i: r.data["prefix_token_count"] for i, r in prefixes.items()}
        return lengths, "source_prefix_tokens"
    return prompt_lengths(scope, scope.items), "prompt_tokens"


def select_panel(
    experiment: str,
    panel: str,
    scope: Scope,
    rows: dict[str, Record],
    sources: tuple[Declaration, ...],
    names: Callable[[str], dict[str, str]] | None = None,
) -> Selection:
    """Choose a panel from the source run alone, before any row: from the rows of the
    experiments in ``sources`` that record an outcome (replay or live vs prefill),
    preferred first; ``names`` adds what the experiment names after the panel (a
    transplant's alias and ledger name).

    Every refusal (missing source, too few rows of a stratum, a bad name) happens here,
    so the runner can call this before it writes anything.
    """
    options = PanelOptions.of(scope)
    precision = scope.dtypes[0]
    seed = int(options.panel_seed)
    contract = _source_contract(scope)
    by_id = {item.id: item for item in scope.items}
    if panel not in (*PANELS, "divergent"):
        raise KvreplayError(f"Unknown panel {panel!r}; choose {' or '.join(PANELS)}.")
    if panel != "blind" and scope.source is None:
        raise KvreplayError(
            f"The {experiment} panel selects on a prior run's outcomes; pass --from RUN_DIR."
        )
    selection: dict[str, Any] = {
        "rule": "panel",
        "panel": panel,
        "basis": BASIS[panel],
        "seed": seed,
        "precision": precision,
        "source_contract_sha256": contract,
    }
    if panel == "blind":
        entries = _blind_entries(scope, rows, sources, seed, bool(contract), selection)
    else:
        entries = _stratified_entries(panel, options, rows, precision, sources, seed, selection)
    missing = [e["item_id"] for e in entries if e["item_id"] not in by_id]
    if missing:
        raise KvreplayError(f"Item {missing[0]} of the source run is not in this run's item set.")
    if names is not None:
        selection.update(names(panel))
    selection["rows"] = entries
    return Selection([by_id[e["item_id"]] for e in entries], selection)


def _blind_entries(
    scope: Scope,
    rows: dict[str, Record],
    sources: Sequence[Declaration],
    seed: int,
    sourced: bool,
    selection: dict[str, Any],
) -> list[dict[str, Any]]:
    """An outcome-blind panel: spread over prefix length and identifier."""
    precision = scope.config.backend.prefix_precision
    prefixes = prefix_rows(rows, precision, sources) if sourced else {}
    lengths, selection["length_basis"] = _blind_lengths(scope, prefixes)
    n = scope.n if scope.n is not None else min(DEFAULT_BLIND_N, len(lengths))
    if n < 1 or n > len(lengths):
        raise KvreplayError(f"--n is {n} but {len(lengths)} rows are available for the panel.")
    return [
        _entry(index, item_id, "not_used", prefixes.get(item_id))
        for index, item_id in enumerate(spread(lengths, n, seed))
    ]


def _stratified_entries(
    panel: str,
    options: PanelOptions,
    rows: dict[str, Record],
    precision: str,
    sources: tuple[Declaration, ...],
    seed: int,
    selection: dict[str, Any],
) -> list[dict[str, Any]]:
    """A panel of the source run's divergent rows and exact controls (or, ``divergent``,
    its divergent rows alone), each stratum spread over prefix length."""
    outcomes = outcome_rows(rows, precision, sources)
    strata = {
        stratum: {i: r.data["prefix_token_count"] for i, r in outcomes.items() if flag(r)}
        for stratum, flag in (("divergent", diverges), ("exact", lambda r: not diverges(r)))
    }
    if panel == "divergent" and not strata["divergent"]:
        raise KvreplayError(f"The source run has no divergent {precision} rows to localize.")
    divergent = options.divergent
    wanted = {
        "divergent": (len(strata["divergent"]) if panel == "divergent" else DEFAULT_DIVERGENT)
        if divergent is None
        else int(divergent),
        "exact": 0 if panel == "divergent" else int(options.controls),
    }
    for stratum, count in wanted.items():
        _take(stratum, strata[stratum], count, precision)
    if sum(wanted.values()) == 0:
        raise KvreplayError("The panel is empty; ask for at least one row.")
    entries: list[dict[str, Any]] = []
    for stratum, count in wanted.items():
        for item_id in spread(strata[stratum], count, seed) if count else []:
            entries.append(_entry(len(entries), item_id, stratum, outcomes[item_id]))
    selection["available"] = {k: len(v) for k, v in strata.items()}
    return entries
