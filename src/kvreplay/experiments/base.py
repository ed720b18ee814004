"""What every experiment shares: the run configuration, units of work, the worker that
holds models and runs units, and the arm helpers (fingerprint, continue, score).

A worker lives in the driver (local engine) or in a Ray actor; it receives plain-data
units and returns plain-data rows, so both engines run the same code.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvreplay.construct import Prefix
from kvreplay.decode import Sampler, Trajectory, continue_from
from kvreplay.errors import KvreplayError
from kvreplay.items import Item, encode_prompt
from kvreplay.models import LoadedModel, load_model
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


@dataclass
class Unit:
    """One row's worth of work: plain data so it can travel to a Ray actor."""

    key: str
    experiment: str
    item: Item
    precision: str
    inputs: dict[str, Any] = field(default_factory=dict)


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


class Worker:
    """Loads each precision's model once and runs units.

    ``device_map="auto"`` (set by the Ray engine for a worker with several GPUs) spreads
    a model too large for one GPU over all of them.
    """

    def __init__(self, config: RunConfig, name: str = "local", device_map: str | None = None):
        self.config = config
        self.name = name
        self.device_map = device_map
        self._models: dict[str, LoadedModel] = {}

    def model(self, dtype: str) -> LoadedModel:
        if dtype not in self._models:
            lm = load_model(
                self.config.model,
                dtype,
                self.config.device,
                self.config.attn_implementation,
                self.config.trust_remote_code,
                self.device_map,
            )
            if not lm.identity.matches(self.config.model_digest):
                raise KvreplayError(
                    f"Worker {self.name} loaded model files whose digest differs from the run's."
                )
            self._models[dtype] = lm
        return self._models[dtype]

    def device_info(self) -> dict[str, str]:
        from kvreplay.environment import device_name

        return {
            "worker": self.name,
            "device": self.config.device,
            "device_name": device_name(self.config.device),
        }

    def run(self, unit: Unit) -> tuple[dict[str, Any], dict[str, float]]:
        from kvreplay.experiments import get_experiment

        self.model(unit.precision)  # loading is neither model nor harness time of a row
        clock = Clock()
        data = get_experiment(unit.experiment).run_unit(self, unit, clock)
        return data, clock.timing()


class Experiment(Protocol):
    """An experiment: selection, phased units, the per-unit computation and its CSV."""

    name: str
    csv_name: str
    columns: list[str]
    phases: int

    def config(self, options: dict[str, Any]) -> dict[str, Any]: ...

    def units(
        self, phase: int, items: list[Item], options: dict[str, Any], rows: dict[str, Any]
    ) -> list[Unit]: ...

    def run_unit(self, worker: Worker, unit: Unit, clock: Clock) -> dict[str, Any]: ...

    def csv_rows(self, rows: list[Any]) -> list[dict[str, Any]]: ...

    def planned(self, config: dict[str, Any], rows: dict[str, Any]) -> list[str]:
        """Every row key the experiment holds once complete, from its recorded config."""
        ...


def row_key(experiment: str, item_id: str, precision: str) -> str:
    return f"{experiment}/{item_id}/{precision}"


def prefix_key(experiment: str, item_id: str) -> str:
    """The key of a two-phase experiment's prefix row (its first phase)."""
    return f"{experiment}/prefix/{item_id}"


def planned_keys(
    experiment: str,
    item_ids: list[str],
    precisions: list[str],
    rows: dict[str, Any],
    prefixed: bool = False,
) -> list[str]:
    """Row keys of a complete experiment; with ``prefixed``, one prefix row per item
    first, and later rows only for items whose prefix row reached the boundary."""
    keys = [prefix_key(experiment, i) for i in item_ids] if prefixed else []
    if prefixed:
        reached = {k for k in keys if k in rows and rows[k].data.get("status") == "ok"}
        item_ids = [i for i in item_ids if prefix_key(experiment, i) in reached]
    return keys + [row_key(experiment, i, p) for p in precisions for i in item_ids]


def csv_file(experiment: Experiment, config: dict[str, Any]) -> str:
    """The CSV an experiment derives; a transplant panel names its own in its config."""
    return config.get("csv_name", experiment.csv_name)


def prompt_ids(worker: Worker, lm: LoadedModel, item: Item) -> list[int]:
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


def snapshot(worker: Worker, unit: Unit, arm: str, state: BoundaryState) -> dict[str, str] | None:
    """Save a boundary state when the run asked for snapshots; return its file entry."""
    if not worker.config.save_snapshots:
        return None
    from kvreplay.models import file_digests

    # Readable, and unique: ids that differ only in unsafe characters (x/y, x_y) differ
    # in the digest of the row key.
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", unit.key)[:80]
    tag = hashlib.sha256(unit.key.encode("utf-8")).hexdigest()[:12]
    path = Path(worker.config.run_dir) / "snapshots" / f"{readable}-{tag}-{arm}.safetensors"
    save_state(state, path, {"row": unit.key, "arm": arm})
    return {
        "file": f"snapshots/{path.name}",
        "sha256": file_digests(path.parent, [path])[path.name],
    }


def run_arm(
    worker: Worker,
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
    worker: Worker,
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
