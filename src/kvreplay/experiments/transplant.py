"""``transplant``: the six-arm panel behind the paper's causal claim
(``kv_transplant_<name>.csv``).

Per row, over one fixed prefix at one precision: ``replay`` (the paper's "incremental")
and ``prefill``, each with a storage-disjoint replica, plus two transplants: the prefill
state carrying every K/V layer of the replay state, and the replay state carrying every
K/V layer of the prefill state. All six are continued to the end. A transplant recovers
its donor when its suffix equals the donor's own suffix token for token.

Only K and V move; the recipient keeps its own boundary logits, which choose the first
suffix token. When the two boundary argmaxes are equal (``boundary_argmax_equal``) a
transplanted state feeds the donor's first token into the donor's cache, so greedy
decoding is then exactly the donor's computation and recovery is guaranteed; when they
differ, recovery is an empirical question and the flag says so on the row.

Panels are chosen before any row runs and recorded in the manifest:
``stratified`` takes a prior run's divergent rows and exact controls, each stratum
spread over prefix length (the paper's 24 + 8 at C0); ``blind`` spreads over prefix
length and identifier without looking at any outcome (the paper's C1 replication).
Phase 0 records one prefix row per panel row (copied from the source run or generated
live), phase 1 runs the six arms.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.construct import build
from kvreplay.environment import contract_scheme
from kvreplay.errors import KvreplayError
from kvreplay.experiments.base import (
    Clock,
    Unit,
    Worker,
    csv_value,
    functional_state_equal,
    pair_record,
    planned_keys,
    prefix_from_inputs,
    prefix_key,
    prefix_record,
    replicate_and_run,
    row_key,
)
from kvreplay.experiments.bridge import spread_selection
from kvreplay.experiments.fixed_prefix import prefix_inputs, prefix_row, prefix_unit
from kvreplay.items import Item, encode_prompt, items_digest
from kvreplay.ledger import Record, RunLedger
from kvreplay.models import describe_source, load_tokenizer
from kvreplay.state import BoundaryState, compare, first_divergence, transplant

if TYPE_CHECKING:
    from kvreplay.runner import RunRequest

PANEL_EXPERIMENTS = ("transplant", "localize")
PANELS = ("stratified", "blind")
BASIS = {
    "stratified": "prior_outcome_stratified_length_spread",
    "blind": "outcome_blind_length_and_identifier",
    "divergent": "prior_outcome_divergent_length_spread",
}
DEFAULT_NAME = {"stratified": "primary", "blind": "later"}
DEFAULT_DIVERGENT, DEFAULT_CONTROLS, DEFAULT_BLIND_N = 24, 8, 48
# Where a prior row's outcome (suffix of replay/live vs prefill) can be read, preferred first.
OUTCOME_SOURCES = ("fixed-prefix", "matched")
# The two transplanted arms: (arm, donor arm, recipient arm, paper name).
TRANSPLANTS = (
    ("replay_cache_into_prefill", "left", "prefill", "incremental_cache_into_prefill"),
    ("prefill_cache_into_replay", "prefill", "left", "prefill_cache_into_incremental"),
)
ARMS = (
    "left",
    "left_replica",
    "prefill",
    "prefill_replica",
    *(arm for arm, *_ in TRANSPLANTS),
)
PAPER_COLUMNS = [
    "row_id", "source_row_sha256", "checkpoint_alias", "selection_index", "selection_basis",
    "historical_stratum", "historical_stratum_reproduced", "prefix_token_count",
    "prefix_sha256", "incremental_replica_exact", "prefill_replica_exact",
    "functional_state_equal", "boundary_argmax_equal", "all_storage_disjoint",
    "all_48_layer_pairs_transplanted",
    "incremental_native_suffix_sha256", "prefill_native_suffix_sha256",
    "incremental_cache_into_prefill_suffix_sha256",
    "prefill_cache_into_incremental_suffix_sha256",
    "baseline_divergent", "incremental_cache_into_prefill_recovers_donor",
    "prefill_cache_into_incremental_recovers_donor", "bidirectional_donor_recovery",
    "exact_control_novel_trajectory", "integrity_pass",
]  # fmt: skip
EXTRA_COLUMNS = [
    "precision", "num_layers", "panel", "prompt_token_count", "first_suffix_divergence_index",
    "incremental_cache_into_prefill_donor_divergence_index",
    "prefill_cache_into_incremental_donor_divergence_index",
    "incremental_prefill_cache_exact", "incremental_prefill_logits_exact",
    "cache_relative_l2_diff", "incremental_correct", "prefill_correct",
    "incremental_cache_into_prefill_correct", "prefill_cache_into_incremental_correct",
]  # fmt: skip


def _tiebreak(seed: int, item_id: str) -> str:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).hexdigest()[:16]


def spread(lengths: dict[str, int], n: int, seed: int) -> list[str]:
    """``n`` ids at evenly spaced order statistics of length; equal lengths are ordered
    by a seeded hash of the id, so the seed is the only freedom in the choice."""
    keyed = {f"{_tiebreak(seed, item_id)}:{item_id}": item_id for item_id in lengths}
    order = [(lengths[item_id], key) for key, item_id in keyed.items()]
    return [keyed[key] for key in spread_selection(order, n)]


def outcome_rows(
    rows: dict[str, Record], precision: str, sources: Sequence[str]
) -> dict[str, Record]:
    """Per item, a completed two-arm row (left vs prefill) at ``precision``; earlier
    experiments in ``sources`` win."""
    found: dict[str, Record] = {}
    for experiment in reversed(sources):
        for record in rows.values():
            data = record.data
            if (
                record.experiment == experiment
                and data.get("precision") == precision
                and data.get("status") == "ok"
                and "arms" in data
            ):
                found[data["item_id"]] = record
    return found


def prefix_rows(rows: dict[str, Record], prefix_dtype: str) -> dict[str, Record]:
    """Per item, a recorded prefix: a fixed-prefix prefix row, else a matched live row."""
    found: dict[str, Record] = {}
    for record in rows.values():
        data = record.data
        if data.get("status") != "ok" or "prefix_token_ids" not in data:
            continue
        if record.experiment == "fixed-prefix" and data.get("kind") == "prefix":
            found[data["item_id"]] = record
        elif record.experiment == "matched" and data["precision"] == prefix_dtype:
            found.setdefault(data["item_id"], record)
    return found


def diverges(record: Record) -> bool:
    arms = record.data["arms"]
    return arms["left"]["suffix_sha256"] != arms["prefill"]["suffix_sha256"]


def _source_contract(request: RunRequest, items: list[Item]) -> str | None:
    """A source run's prefixes are token ids of its model: refuse another model's."""
    if request.prefix_from is None:
        return None
    source = RunLedger.open_existing(request.prefix_from)
    contract = source.manifest["contract"]
    info = describe_source(request.model, request.trust_remote_code, contract_scheme(contract))
    if contract["run"]["model_digest"] != info["model_digest"]:
        raise KvreplayError(
            f"The source run {request.prefix_from} used another model "
            f"({contract['run']['model']}); its prefixes are that model's token ids."
        )
    if contract["items"]["digest"] != items_digest(items):
        raise KvreplayError(
            f"The source run {request.prefix_from} used another item set; "
            f"pass --items {request.prefix_from / 'items.jsonl'}."
        )
    return source.contract_hash


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


def _blind_lengths(
    request: RunRequest, items: list[Item], prefixes: dict[str, Record]
) -> tuple[dict[str, int], str]:
    if request.prefix_from is not None:
        lengths = {i: r.data["prefix_token_count"] for i, r in prefixes.items()}
        return lengths, "source_prefix_tokens"
    tokenizer = load_tokenizer(request.model, request.trust_remote_code)
    lengths = {i.id: len(encode_prompt(tokenizer, i.prompt, request.chat)) for i in items}
    return lengths, "prompt_tokens"


def select_panel(
    request: RunRequest, items: list[Item], rows: dict[str, Record]
) -> tuple[list[Item], dict[str, Any]]:
    """Choose a transplant or localize panel from the source run alone, before any row.

    Every refusal (missing source, too few rows of a stratum, a bad name) happens here,
    so the runner can call this before it writes anything.
    """
    extra = request.extra
    precision = request.dtypes[0]
    seed = int(extra.get("panel_seed", 0))
    contract = _source_contract(request, items)
    by_id = {item.id: item for item in items}
    panel = "divergent" if request.experiment == "localize" else extra.get("panel", "stratified")
    if panel not in (*PANELS, "divergent"):
        raise KvreplayError(f"Unknown panel {panel!r}; choose {' or '.join(PANELS)}.")
    if panel != "blind" and request.prefix_from is None:
        raise KvreplayError(
            f"The {request.experiment} panel selects on a prior run's outcomes; "
            "pass --from RUN_DIR."
        )
    selection: dict[str, Any] = {
        "rule": "panel",
        "panel": panel,
        "basis": BASIS[panel],
        "seed": seed,
        "precision": precision,
        "source_contract_sha256": contract,
    }
    entries: list[dict[str, Any]] = []
    if panel == "blind":
        prefixes = prefix_rows(rows, extra.get("prefix_dtype", "bf16")) if contract else {}
        lengths, selection["length_basis"] = _blind_lengths(request, items, prefixes)
        n = request.n if request.n is not None else min(DEFAULT_BLIND_N, len(lengths))
        if n < 1 or n > len(lengths):
            raise KvreplayError(f"--n is {n} but {len(lengths)} rows are available for the panel.")
        for index, item_id in enumerate(spread(lengths, n, seed)):
            entries.append(_entry(index, item_id, "not_used", prefixes.get(item_id)))
    else:
        sources = OUTCOME_SOURCES + (("transplant",) if panel == "divergent" else ())
        outcomes = outcome_rows(rows, precision, sources)
        strata = {
            stratum: {i: r.data["prefix_token_count"] for i, r in outcomes.items() if flag(r)}
            for stratum, flag in (("divergent", diverges), ("exact", lambda r: not diverges(r)))
        }
        if panel == "divergent" and not strata["divergent"]:
            raise KvreplayError(f"The source run has no divergent {precision} rows to localize.")
        divergent = extra.get("divergent")
        wanted = {
            "divergent": (len(strata["divergent"]) if panel == "divergent" else DEFAULT_DIVERGENT)
            if divergent is None
            else int(divergent),
            "exact": 0 if panel == "divergent" else int(extra.get("controls", DEFAULT_CONTROLS)),
        }
        for stratum, count in wanted.items():
            _take(stratum, strata[stratum], count, precision)
        if sum(wanted.values()) == 0:
            raise KvreplayError("The panel is empty; ask for at least one row.")
        for stratum, count in wanted.items():
            for item_id in spread(strata[stratum], count, seed) if count else []:
                entries.append(_entry(len(entries), item_id, stratum, outcomes[item_id]))
        selection["available"] = {k: len(v) for k, v in strata.items()}
    missing = [e["item_id"] for e in entries if e["item_id"] not in by_id]
    if missing:
        raise KvreplayError(f"Item {missing[0]} of the source run is not in this run's item set.")
    if request.experiment == "transplant":
        selection.update(_names(request, panel))
    selection["rows"] = entries
    return [by_id[e["item_id"]] for e in entries], selection


def _names(request: RunRequest, panel: str) -> dict[str, str]:
    """The checkpoint alias and the ledger name (``kv_transplant_<name>.csv``)."""
    name = request.extra.get("name") or DEFAULT_NAME[panel]
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise KvreplayError(f"--name {name!r} may hold only letters, digits, '_' and '-'.")
    alias = request.extra.get("alias") or Path(request.model).name
    return {"alias": alias, "name": name}


def holds_donor(result: BoundaryState, donor: BoundaryState) -> bool:
    """Every layer's K and V of ``result`` is bit-equal to the donor's (a full transplant)."""
    return all(
        a.equal(b)
        for pair_a, pair_b in zip(result.layer_tensors(), donor.layer_tensors(), strict=True)
        for a, b in zip(pair_a, pair_b, strict=True)
    )


class Transplant:
    name = "transplant"
    csv_name = "kv_transplant_primary.csv"  # the default; a run's own is in its config
    columns = PAPER_COLUMNS + EXTRA_COLUMNS
    phases = 2

    def config(self, options: dict[str, Any]) -> dict[str, Any]:
        selection = options["selection"]
        return {
            "precision": options["dtypes"][0],
            "prefix_dtype": options["prefix_dtype"],
            "arms": list(ARMS),
            "csv_name": f"kv_transplant_{selection['name']}.csv",
            "selection": selection,
        }

    def units(
        self, phase: int, items: list[Item], options: dict[str, Any], rows: dict[str, Record]
    ) -> list[Unit]:
        selection = options["selection"]
        by_id = {item.id: item for item in items}
        units = []
        for entry in selection["rows"]:
            item = by_id[entry["item_id"]]
            if phase == 0:
                source = options["prefix_source_rows"].get(entry["source_key"])
                key = prefix_key(self.name, item.id)
                units.append(prefix_unit(key, self.name, item, options["prefix_dtype"], source))
                continue
            prefix = rows[prefix_key(self.name, item.id)]
            if prefix.data["status"] != "ok":
                continue
            inputs = {
                **prefix_inputs(prefix),
                "source": prefix.data["source"],
                "panel": {
                    "checkpoint_alias": selection["alias"],
                    "selection_index": entry["selection_index"],
                    "selection_basis": selection["basis"],
                    "historical_stratum": entry["historical_stratum"],
                    "panel": selection["panel"],
                },
            }
            precision = options["dtypes"][0]
            units.append(
                Unit(row_key(self.name, item.id, precision), self.name, item, precision, inputs)
            )
        return units

    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        ids = [entry["item_id"] for entry in config["selection"]["rows"]]
        return planned_keys(self.name, ids, [config["precision"]], rows, prefixed=True)

    def run_unit(self, worker: Worker, unit: Unit, clock: Clock) -> dict[str, Any]:
        if unit.key.startswith("transplant/prefix/"):
            return prefix_row(worker, unit, clock)
        lm = worker.model(unit.precision)
        prefix = prefix_from_inputs(unit.inputs)
        with clock.model():
            states = {"left": build(lm, prefix, "replay"), "prefill": build(lm, prefix, "prefill")}
        transplants = {
            arm: transplant(states[donor], states[recipient])
            for arm, donor, recipient, _ in TRANSPLANTS
        }
        all_layers = all(
            holds_donor(transplants[arm], states[donor]) for arm, donor, _, _ in TRANSPLANTS
        )
        comparison = compare(states["left"], states["prefill"])
        functional = functional_state_equal([*states.values(), *transplants.values()])
        arms, replicas, disjoint = replicate_and_run(
            worker, lm, unit, states, clock, unreplicated=transplants
        )
        return {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "kind": "transplant",
            "status": "ok",
            "left_construction": "replay",
            "num_layers": lm.num_layers,
            **prefix_record(prefix),
            "prefix_stages": unit.inputs.get("prefix_stages", []),
            "source": unit.inputs.get("source", {}),
            "panel": unit.inputs["panel"],
            "arms": arms,
            "replicas": replicas,
            "comparison": comparison.to_dict(),
            "labels": pair_record(arms["left"], arms["prefill"]),
            "functional_state_equal": functional,
            "all_storage_disjoint": disjoint,
            "all_layers_transplanted": all_layers,
        }

    def csv_rows(self, rows: list[Record]) -> list[dict[str, Any]]:
        by_key = {r.key: r for r in rows}
        out = []
        for record in rows:
            data = record.data
            if data.get("kind") != "transplant":
                continue
            prefix_row_hash = by_key[f"transplant/prefix/{data['item_id']}"].row_sha256
            out.append(transplant_csv_row(record, prefix_row_hash))
        return out


def transplant_csv_row(record: Record, prefix_row_hash: str) -> dict[str, str]:
    """Derive one paper-schema row; every flag follows METHOD.md's transplant gates."""
    data = record.data
    arms, replicas, cmp, panel = data["arms"], data["replicas"], data["comparison"], data["panel"]
    native = {arm: arms[arm]["suffix_sha256"] for arm in ("left", "prefill")}
    divergent = native["left"] != native["prefill"]
    recovers = {
        paper: arms[arm]["suffix_sha256"] == native[donor] for arm, donor, _, paper in TRANSPLANTS
    }
    both = all(recovers.values())
    replica_exact = {arm: all(replicas[arm].values()) for arm in ("left", "prefill")}
    historical = panel["historical_stratum"]
    row: dict[str, Any] = {
        "row_id": data["item_id"],
        "source_row_sha256": data["source"].get("row_sha256") or prefix_row_hash,
        "checkpoint_alias": panel["checkpoint_alias"],
        "selection_index": panel["selection_index"],
        "selection_basis": panel["selection_basis"],
        "historical_stratum": historical,
        "historical_stratum_reproduced": historical == "not_used"
        or (historical == "divergent") == divergent,
        "prefix_token_count": data["prefix_token_count"],
        "prefix_sha256": data["prefix_sha256"],
        "incremental_replica_exact": replica_exact["left"],
        "prefill_replica_exact": replica_exact["prefill"],
        "functional_state_equal": data["functional_state_equal"],
        "boundary_argmax_equal": cmp["boundary_argmax_equal"],
        "all_storage_disjoint": data["all_storage_disjoint"],
        "all_48_layer_pairs_transplanted": data["all_layers_transplanted"],
        "incremental_native_suffix_sha256": native["left"],
        "prefill_native_suffix_sha256": native["prefill"],
        "baseline_divergent": divergent,
        "bidirectional_donor_recovery": both,
        "exact_control_novel_trajectory": not divergent and not both,
        "integrity_pass": all(replica_exact.values())
        and data["functional_state_equal"]
        and data["all_storage_disjoint"]
        and data["all_layers_transplanted"],
        "precision": data["precision"],
        "num_layers": data["num_layers"],
        "panel": panel["panel"],
        "prompt_token_count": data["prompt_token_count"],
        "first_suffix_divergence_index": data["labels"]["first_suffix_divergence_index"],
        "incremental_prefill_cache_exact": cmp["cache"]["exact"] and cmp["layer_lengths_equal"],
        "incremental_prefill_logits_exact": cmp["logits"]["exact"],
        "cache_relative_l2_diff": cmp["cache"]["relative_l2_diff"],
        "incremental_correct": arms["left"]["correct"],
        "prefill_correct": arms["prefill"]["correct"],
    }
    for arm, donor, _, paper in TRANSPLANTS:
        row[f"{paper}_suffix_sha256"] = arms[arm]["suffix_sha256"]
        row[f"{paper}_recovers_donor"] = recovers[paper]
        row[f"{paper}_donor_divergence_index"] = first_divergence(
            arms[arm]["suffix_token_ids"], arms[donor]["suffix_token_ids"]
        )
        row[f"{paper}_correct"] = arms[arm]["correct"]
    return {key: csv_value(value) for key, value in row.items()}
