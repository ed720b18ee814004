"""What every experiment shares: the run configuration, units of work and their keys,
the Experiment base class the runner drives, and the arm helpers (fingerprint, continue,
score).

A unit is plain data and a row is plain data, so every engine (this process, worker
processes, Ray actors) runs the same code on them.
"""

from __future__ import annotations

import hashlib
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvreplay.construct import Prefix
from kvreplay.decode import Sampler, Trajectory, continue_from
from kvreplay.errors import KvreplayError
from kvreplay.items import Item, encode_prompt
from kvreplay.ledger import Record
from kvreplay.models import LoadedModel
from kvreplay.scoring import pair_labels, score
from kvreplay.stages import StagePlan
from kvreplay.state import (
    BoundaryState,
    ReplicaCheck,
    first_divergence,
    make_replica,
    save_state,
    sha256_tokens,
    storage_disjoint,
)


@dataclass(frozen=True)
class RunConfig:
    """Everything a worker needs to reproduce a row; part of the manifest's contract."""

    model: str
    model_digest: str
    plan: StagePlan
    device: str = "cpu"
    extractor: str = "integer"
    sampler: Sampler = field(default_factory=Sampler)
    chat: bool | None = None
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    run_dir: str = ""
    save_snapshots: bool = False

    @classmethod
    def from_contract(cls, data: dict[str, Any], run_dir: str = "") -> RunConfig:
        """Rebuild the configuration a run recorded (for audit and resume)."""
        try:
            return cls(
                model=data["model"],
                model_digest=data["model_digest"],
                plan=StagePlan.from_dict(data["plan"]),
                device=data["device"],
                extractor=data["extractor"],
                sampler=Sampler(**data["sampler"]),
                chat=data["chat"],
                attn_implementation=data["attn_implementation"],
                trust_remote_code=data["trust_remote_code"],
                run_dir=run_dir,
            )
        except (KeyError, TypeError, KvreplayError) as exc:  # a hand-edited manifest
            raise KvreplayError(
                f"manifest.json: field contract.run is malformed ({type(exc).__name__}: {exc})"
            ) from exc

    def contract(self) -> dict[str, Any]:
        """The result-affecting part (paths and snapshot choice excluded)."""
        return {
            "model": self.model,
            "model_digest": self.model_digest,
            "plan": self.plan.to_dict(),
            "device": self.device,
            "extractor": self.extractor,
            "sampler": asdict(self.sampler),
            "chat": self.chat,
            "attn_implementation": self.attn_implementation,
            "trust_remote_code": self.trust_remote_code,
        }


@dataclass(frozen=True)
class UnitKey:
    """A row's key in the ledger: ``{experiment}/{item}/{precision}``, or
    ``{experiment}/prefix/{item}`` for the prefix row of a two-phase experiment."""

    experiment: str
    item_id: str
    precision: str | None = None  # None: the item's prefix row

    @classmethod
    def prefix(cls, experiment: str, item_id: str) -> UnitKey:
        return cls(experiment, item_id)

    @classmethod
    def of(cls, record: Record) -> UnitKey:
        """The key a recorded row should have, from its experiment, kind, item and precision."""
        data = record.data
        precision = None if data.get("kind") == "prefix" else data["precision"]
        return cls(record.experiment, data["item_id"], precision)

    @property
    def is_prefix(self) -> bool:
        return self.precision is None

    def __str__(self) -> str:
        if self.precision is None:
            return f"{self.experiment}/prefix/{self.item_id}"
        return f"{self.experiment}/{self.item_id}/{self.precision}"


@dataclass
class Unit:
    """One row's worth of work: plain data so it can travel to a worker process or actor."""

    key: UnitKey
    item: Item
    precision: str
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def experiment(self) -> str:
        return self.key.experiment


class Clock:
    """Splits a unit's wall time into model time and harness time (everything else)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.model_seconds = 0.0

    @contextmanager
    def model(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.model_seconds += time.perf_counter() - began

    def timing(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        return {"model_s": self.model_seconds, "harness_s": total - self.model_seconds}


class Workbench(Protocol):
    """What a unit's computation uses of the worker that runs it (see
    :class:`kvreplay.engines.worker.Worker`): the run's configuration and each
    precision's model, loaded once."""

    config: RunConfig

    def model(self, dtype: str) -> LoadedModel: ...


@dataclass(frozen=True)
class SourceRun:
    """Another run named by ``--from``: its rows, read without touching it."""

    path: Path
    rows: dict[str, Record]
    contract_hash: str


@dataclass(frozen=True)
class Scope:
    """What an experiment is asked to run on: the run's configuration, items and
    precisions, the ``--n`` asked for, the ``--from`` run, and its own options."""

    config: RunConfig
    items: list[Item]
    dtypes: tuple[str, ...]
    n: int | None = None
    source: SourceRun | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def source_rows(self) -> dict[str, Record]:
        return self.source.rows if self.source else {}


@dataclass(frozen=True)
class Selection:
    """The items an experiment runs, in order, and how they were chosen."""

    items: list[Item]
    rule: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What the run summary counts of one completed row: its two compared arms."""

    suffix_equal: bool
    answer_equal: bool
    correct: tuple[bool, bool]
    parsed: tuple[bool, bool]
    replicas_exact: bool


class Experiment(ABC):
    """An experiment: its selection, phased units, the per-unit computation, its CSV,
    summary and figures. The runner knows experiments only through this class."""

    name: str
    csv_file: str
    columns: list[str]
    phases: int = 1
    compared: tuple[str, str] = ("replay", "prefill")  # the constructions its summary pairs

    def default_n(self, total: int) -> int:
        """How many items ``--n`` means when it is not given."""
        return total

    def count(self, n: int | None, items: list[Item]) -> int:
        n = n if n is not None else self.default_n(len(items))
        if n < 1 or n > len(items):
            raise KvreplayError(f"--n is {n} but the item set holds {len(items)} items.")
        return n

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        """The items whose prompts this experiment may generate live from."""
        return []

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        """Which items run; ``rows`` are the ``--from`` run's and this run's. Every
        refusal of a selection happens here, before the run writes anything."""
        n = self.count(scope.n, scope.items)
        return Selection(scope.items[:n], {"rule": "first_n", "n": n})

    @abstractmethod
    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        """The experiment's part of the manifest: what a resume must ask for again."""

    @abstractmethod
    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]: ...

    @abstractmethod
    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]: ...

    @abstractmethod
    def planned(self, config: dict[str, Any], rows: dict[str, Record]) -> list[str]:
        """Every row key the experiment holds once complete, from its recorded config."""

    @abstractmethod
    def csv_rows(self, rows: list[Record]) -> list[dict[str, str]]: ...

    def csv_name(self, config: dict[str, Any]) -> str:
        """The CSV this experiment derives, given its recorded config."""
        return self.csv_file

    def outcome(self, data: dict[str, Any]) -> Outcome:
        """A completed row's two compared arms (``left`` and ``prefill``)."""
        arms, labels = data["arms"], data["labels"]
        return Outcome(
            suffix_equal=labels["suffix_equal"],
            answer_equal=labels["answer_equal"],
            correct=(arms["left"]["correct"], arms["prefill"]["correct"]),
            parsed=(arms["left"]["answer_parsed"], arms["prefill"]["answer_parsed"]),
            replicas_exact=all(all(g.values()) for g in data["replicas"].values()),
        )

    def figures(self, run_dir: Path, rows: list[Record]) -> list[Path]:
        """Figures drawn from the rows after each run; most experiments draw none."""
        return []


def planned_keys(
    experiment: str,
    item_ids: list[str],
    precisions: list[str],
    rows: dict[str, Any],
    prefixed: bool = False,
) -> list[str]:
    """Row keys of a complete experiment; with ``prefixed``, one prefix row per item
    first, and later rows only for items whose prefix row reached the boundary."""
    prefixes = [str(UnitKey.prefix(experiment, i)) for i in item_ids] if prefixed else []
    if prefixed:
        reached = {k for k in prefixes if k in rows and rows[k].data.get("status") == "ok"}
        item_ids = [i for i in item_ids if str(UnitKey.prefix(experiment, i)) in reached]
    return prefixes + [str(UnitKey(experiment, i, p)) for p in precisions for i in item_ids]


def prompt_ids(worker: Workbench, lm: LoadedModel, item: Item) -> list[int]:
    if item.prompt is None:
        raise KvreplayError(f"Item {item.id} has no prompt, so it cannot be generated live.")
    return encode_prompt(lm.tokenizer, item.prompt, worker.config.chat)


def prefix_record(prefix: Prefix) -> dict[str, Any]:
    """How a prefix is stored in a row: ids, where the prompt ends, its stages."""
    return {
        "prefix_token_ids": prefix.token_ids,
        "prompt_token_count": prefix.prompt_len,
        "prefix_token_count": len(prefix.token_ids),
        "prefix_sha256": prefix.sha256,
        "prefix_reached": prefix.reached,
        "prefix_reason": prefix.reason,
        "prefix_stages": Trajectory(prefix.segments).to_dict()["segments"],
    }


def prefix_from_inputs(inputs: dict[str, Any]) -> Prefix:
    ids = [int(t) for t in inputs["prefix_token_ids"]]
    if sha256_tokens(ids) != inputs["prefix_sha256"]:
        raise KvreplayError("A recorded prefix does not match its own hash.")
    return Prefix(token_ids=ids, prompt_len=int(inputs["prompt_token_count"]))


def snapshot(
    worker: Workbench, unit: Unit, arm: str, state: BoundaryState
) -> dict[str, str] | None:
    """Save a boundary state when the run asked for snapshots; return its file entry."""
    if not worker.config.save_snapshots:
        return None
    from kvreplay.models import file_digests

    # Readable, and unique: ids that differ only in unsafe characters (x/y, x_y) differ
    # in the digest of the row key.
    key = str(unit.key)
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
    tag = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    path = Path(worker.config.run_dir) / "snapshots" / f"{readable}-{tag}-{arm}.safetensors"
    save_state(state, path, {"row": key, "arm": arm})
    return {
        "file": f"snapshots/{path.name}",
        "sha256": file_digests(path.parent, [path])[path.name],
    }


def run_arm(
    worker: Workbench,
    lm: LoadedModel,
    unit: Unit,
    arm: str,
    state: BoundaryState,
    clock: Clock,
    reuse: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fingerprint a boundary state, continue it to the end, and score the suffix.

    The state is consumed; fingerprints are taken before it advances. ``reuse`` is an
    earlier arm of this run with the same model, dtype, construction and prefix: when its
    cache and logits fingerprints equal this state's, greedy continuation is provably the
    same computation, so its suffix is taken instead of decoding again.
    """
    record: dict[str, Any] = {
        "construction": state.construction,
        "cache_fingerprint": state.cache_fingerprint(),
        "logits_fingerprint": state.logits_fingerprint(),
        "boundary_argmax": state.argmax(),
    }
    saved = snapshot(worker, unit, arm, state)
    if saved:
        record["snapshot"] = saved
    same = ("construction", "cache_fingerprint", "logits_fingerprint")
    if reuse and worker.config.sampler.greedy and all(reuse["arm"][k] == record[k] for k in same):
        kept = ("suffix", "suffix_token_ids", "suffix_sha256", "post_decode_cache_len")
        record.update({k: reuse["arm"][k] for k in kept}, reused_from=reuse["key"])
        trajectory = Trajectory.from_dict(record["suffix"])
    else:
        with clock.model():
            trajectory = continue_from(lm, state, worker.config.plan, worker.config.sampler)
        record.update(
            suffix=trajectory.to_dict(),
            suffix_token_ids=trajectory.token_ids,
            suffix_sha256=sha256_tokens(trajectory.token_ids),
            post_decode_cache_len=state.position,
        )
    outcome = score(lm.tokenizer, trajectory, unit.item.answer, worker.config.extractor)
    record.update(
        answer=outcome["extracted"],
        answer_parsed=outcome["parsed"],
        correct=outcome["correct"],
    )
    return record


def replica_record(check: ReplicaCheck, source: dict[str, Any], replica: dict[str, Any]) -> dict:
    """A replica's gate: bit-equal state, no shared storage, and the same suffix."""
    return {
        "cache_exact": check.cache_exact,
        "logits_exact": check.logits_exact,
        "storage_disjoint": check.storage_disjoint,
        "suffix_exact": source["suffix_sha256"] == replica["suffix_sha256"],
    }


def pair_record(left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    """Equality labels of two continued arms."""
    labels = pair_labels(
        Trajectory.from_dict(left["suffix"]),
        Trajectory.from_dict(right["suffix"]),
        left["answer"],
        right["answer"],
    )
    labels["first_suffix_divergence_index"] = first_divergence(
        left["suffix_token_ids"], right["suffix_token_ids"]
    )
    return labels


def replicate_and_run(
    worker: Workbench,
    lm: LoadedModel,
    unit: Unit,
    arms: dict[str, BoundaryState],
    clock: Clock,
    reuse: dict[str, dict[str, Any]] | None = None,
    unreplicated: dict[str, BoundaryState] | None = None,
) -> tuple[dict[str, dict], dict[str, dict], bool]:
    """For each named state: a checked replica, then both continued.

    Returns arm records (``name`` and ``name_replica``), replica gates, and whether every
    state is storage-disjoint from every other. Replicas never reuse earlier work.
    ``unreplicated`` states (transplants) are continued without a replica but are part
    of the storage check, so no arm can write into another through shared memory.
    """
    states: dict[str, BoundaryState] = {}
    checks: dict[str, ReplicaCheck] = {}
    for name, state in arms.items():
        replica, check = make_replica(state)
        states[name], states[f"{name}_replica"] = state, replica
        checks[name] = check
    states.update(unreplicated or {})
    everything = list(states.values())
    disjoint = all(
        storage_disjoint(a, b) for i, a in enumerate(everything) for b in everything[i + 1 :]
    )
    reuse = reuse or {}
    records = {
        name: run_arm(worker, lm, unit, name, state, clock, reuse.get(name))
        for name, state in states.items()
    }
    gates = {
        name: replica_record(checks[name], records[name], records[f"{name}_replica"])
        for name in arms
    }
    return records, gates, disjoint


def functional_state_equal(states: list[BoundaryState]) -> bool:
    """Every state covers the same tokens with the same per-layer lengths, shapes and dtypes."""
    first = states[0]
    signature = [(k.shape, k.dtype, v.shape, v.dtype) for k, v in first.layer_tensors()]
    return all(
        s.token_ids == first.token_ids
        and s.layer_lengths() == first.layer_lengths()
        and [(k.shape, k.dtype, v.shape, v.dtype) for k, v in s.layer_tensors()] == signature
        for s in states[1:]
    )


def csv_bool(value: Any) -> str:
    return "true" if bool(value) else "false"


def csv_value(value: Any) -> str:
    """CSV convention of the paper's release: booleans as true/false, None as empty."""
    if isinstance(value, bool):
        return csv_bool(value)
    if value is None:
        return ""
    return str(value)
