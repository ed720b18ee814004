"""An experiment's declared schema (design: declared schema): every field it writes in its
manifest config and in its rows, the JSON type and the values of each, and the relations
between a row and the config that planned it (its item and precision, and what an
experiment adds: a rollout's scorers, sampling and seeds).

A config and a row whose hashes were recomputed by a forger still have to be what a run
writes: a ``"verdict": "pass"`` added to either, a status no run records, a scorer the
config never asked for, a temperature the config does not hold, each is named by the
audit at ``--sample 0`` (:mod:`kvreplay.audit.rows`, :mod:`kvreplay.audit.manifest_blocks`),
before any row is re-executed. An experiment declares its schema on its declaration
(:class:`~kvreplay.harness.declaration.Declaration`), which refuses one without it, so a
new experiment cannot be added unchecked.

A panel row's nested records (arms, comparisons, replica gates) are the typed row's own
fields (:class:`~kvreplay.harness.rows.PanelRow`): the audit reads a row as its typed row
and writes it back, and names any field the typed row does not write (a field added
inside an arm). Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvreplay.backends.rollout import LOADS, SCHEDULES
from kvreplay.core.comparison import RETIRED, STAT_FIELDS
from kvreplay.core.rollout import LOGPROB_MODES
from kvreplay.harness.rows import PREFIX_FIELDS

JsonType = type | tuple[type, ...]


def typed(value: Any, kinds: JsonType) -> bool:
    """JSON typing: a flag is not a number (``bool`` is an ``int`` to Python)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def kinds_text(kinds: JsonType) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer",
             float: "a number", bool: "a flag", type(None): "null"}  # fmt: skip
    listed = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names[kind] for kind in listed))


@dataclass(frozen=True)
class Value:
    """One JSON value: its type(s), the values it may take (none listed: any), and
    inside it the fields of an object (each exactly; ``optional`` ones may be missing)
    or ``each`` item of a list (or value of an object keyed by names)."""

    kinds: JsonType
    values: tuple[Any, ...] = ()
    fields: Mapping[str, Value] | None = None
    each: Value | None = None
    optional: bool = False
    minimum: float | None = None  # a number's least value (a token id's 0)

    def __post_init__(self) -> None:
        listed = self.kinds if isinstance(self.kinds, tuple) else (self.kinds,)
        if not all(isinstance(kind, type) for kind in listed):
            raise TypeError(f"A declared value's kinds are JSON types, not {self.kinds!r}.")

    def problems(self, value: Any, where: str) -> Iterator[str]:
        """What ``value`` at ``where`` breaks of this declaration, each once."""
        if not typed(value, self.kinds):
            yield f"{where} is not {kinds_text(self.kinds)}"
            return
        if self.values and value not in self.values:
            listed = ", ".join(repr(v) for v in self.values)
            yield f"{where} is {str(value)[:40]!r}, not one a run writes ({listed})"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and self.minimum is not None and value < self.minimum:
            yield f"{where} is {value!r}, below {self.minimum:g}"
        if isinstance(value, dict) and self.fields is not None:
            yield from object_problems(value, self.fields, f"{where}.")
        elif isinstance(value, dict) and self.each is not None:
            for key, item in value.items():
                yield from self.each.problems(item, f"{where}.{key}")
        elif isinstance(value, list) and self.each is not None:
            for index, item in enumerate(value):
                yield from self.each.problems(item, f"{where}[{index}]")


def optional(kinds: JsonType, **details: Any) -> Value:
    """A field that may be missing."""
    return Value(kinds, optional=True, **details)


def object_problems(
    data: dict[str, Any],
    fields: Mapping[str, Value],
    where: str,
    also: Callable[[str], bool] | None = None,
) -> Iterator[str]:
    """An object's fields against their declarations: a key not declared (nor accepted by
    ``also``) is named, so is a declared one missing or of another type or value; each
    by its path (``where``, ending in a dot, and the key)."""
    for key in data:
        if key not in fields and not (also is not None and also(key)):
            yield f"{where}{key} is not a field a run writes"
    for key, spec in fields.items():
        if key in data:
            yield from spec.problems(data[key], f"{where}{key}")
        elif not spec.optional:
            yield f"{where}{key} is missing"


Relations = Callable[[dict[str, Any], dict[str, Any], Any], list[str]]
"""A completed row (as recorded), its experiment's config and the run's backend (None
when this kvreplay cannot make it) -> what the row says that the config contradicts."""
ConfigRelations = Callable[[dict[str, Any]], list[str]]
"""A config -> what its fields say that its other fields contradict."""


@dataclass(frozen=True)
class Schema:
    """What an experiment writes: its manifest config's fields (beside the table's schema
    version), every field of its rows (besides ``item_id``, ``precision``, ``status``,
    ``kind`` and ``inputs``, which every row has and the audit checks apart), the
    statuses and kinds its rows take, whether a row holds clone gates beside its arms
    (``<arm>_clone``), the relations between a completed row and the config and those
    among the config's own fields, and whether a completed row reads as a typed row that
    writes it back whole (``round_trip``: a panel row's nested records)."""

    config: Mapping[str, Value]
    row: Mapping[str, Value]
    statuses: tuple[str, ...] = ("ok",)
    kinds: tuple[str, ...] = ()
    clones: bool = False
    relations: Relations | None = None
    config_relations: ConfigRelations | None = None
    round_trip: bool = False

    def config_problems(self, config: dict[str, Any], where: str, version: str) -> list[str]:
        """A recorded config's fields (``version``: the table's schema-version key) and
        their relations."""
        fields = {**self.config, version: optional(int)}
        problems = list(object_problems(config, fields, f"{where}."))
        if not problems and self.config_relations is not None:
            problems += [f"{where} {p}" for p in self.config_relations(config)]
        return problems

    def row_problems(
        self, data: dict[str, Any], config: dict[str, Any] | None, backend: Any
    ) -> list[str]:
        """A recorded row's fields, and a completed row's relations to ``config`` (None:
        the experiment's entry is not readable)."""
        fields = {**self.row, **self.base()}
        problems = list(object_problems(data, fields, "field ", self._clone))
        if (
            not problems
            and data["status"] == "ok"
            and data.get("kind") != "prefix"
            and config is not None
            and self.relations is not None
        ):
            try:
                problems += self.relations(data, config, backend)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                problems.append(f"cannot be related to its config ({type(exc).__name__})")
        return problems

    def base(self) -> dict[str, Value]:
        """The fields every row has, with the statuses and kinds this experiment writes."""
        return {
            "item_id": Value(str),
            "precision": Value(str),
            "status": Value(str, self.statuses),
            "inputs": optional(dict),
            **({"kind": optional(str, values=self.kinds)} if self.kinds else {}),
        }

    def _clone(self, key: str) -> bool:
        return self.clones and key.endswith("_clone")


NUMBER = (int, float)
TOKEN = Value(int, minimum=0)
# A prefix as every panel row and prefix row records it (harness/prefixes.py), each
# stage it decoded with its tokens, margins and opener.
STAGE = {
    "stage": Value(str),
    "token_ids": Value(list, each=TOKEN),
    "margins": Value(list, each=Value(NUMBER, minimum=0)),
    "opener_ids": Value(list, each=TOKEN),
    "stop_reason": Value(str),
}
PREFIX: dict[str, Value] = {
    "prefix_token_ids": optional(list, each=TOKEN),
    "prompt_token_count": optional(int, minimum=0),
    "prefix_token_count": optional(int, minimum=0),
    "prefix_sha256": optional(str),
    "prefix_reached": optional(bool),
    "prefix_reason": optional(str),
    "prefix_stages": optional(list, each=Value(dict, fields=STAGE)),
}
assert set(PREFIX) == set(PREFIX_FIELDS)
# Where a row's prefix came from: another row (its key and hash), the item's own
# trajectory, or generated live (a prefix row); an in-process matched row's is empty.
SOURCE = optional(dict, fields={"key": optional(str), "row_sha256": optional(str),
                                "generated": optional(bool)})  # fmt: skip
STATS = Value(dict, fields={n: Value(bool if n == "exact" else NUMBER) for n in STAT_FIELDS})
# A comparison of two boundary states (core/comparison.py: Comparison), with the field
# rows recorded as null before it was retired.
COMPARISON = {
    **{part: Value(dict, fields=STATS.fields) for part in ("cache", "keys", "values", "logits")},
    "per_layer": Value(list, each=Value(dict, fields={n: STATS for n in ("k", "v", "kv")})),
    "boundary_argmax_equal": Value(bool),
    "layer_lengths_equal": Value(bool),
    RETIRED: optional(type(None)),
}
# The compared pair's labels (harness/rows.py: PairLabels).
LABELS = {
    "suffix_equal": Value(bool),
    "trace_equal": Value(bool),
    "merge_equal": Value(bool),
    "answer_equal": Value(bool),
    "first_suffix_divergence_index": Value((int, type(None))),
}
# What states in an engine's blocks cover (backends/vllm/blocks.py: coverage).
BLOCK_KV = ("block_size", "cached_tokens", "tail_tokens")
# A completed panel row's own records (harness/rows.py: PanelRow.to_dict): its arms,
# samples and gates are typed there, and the typed row's round trip names what it does
# not write; what a row keeps as given (its comparison, labels, source) is declared here.
PANEL: dict[str, Value] = {
    **PREFIX,
    "arms": optional(dict, each=Value(dict)),
    "samples": optional(dict, each=Value(list, each=Value(dict))),
    "replicas": optional(dict, each=Value(dict)),
    "comparison": optional(dict, fields=COMPARISON),
    "functional_state_equal": optional((bool, type(None))),
    "all_storage_disjoint": optional((bool, type(None))),
    "all_layers_transplanted": optional(bool),
    "block_kv": optional(dict, fields={n: Value(int, minimum=0) for n in BLOCK_KV}),
    "labels": optional(dict, fields=LABELS),
    "source": SOURCE,
    "left_construction": optional(str),
    "backend": optional(str),  # a served row: the backend that served it
}
PANEL_STATUSES = ("ok", "unreached")


def panel_schema(
    config: Mapping[str, Value], own: Mapping[str, Value] | None = None, **details: Any
) -> Schema:
    """The schema of an experiment whose rows are panel rows: its config, and the
    fields it adds to the panel row's (``own``)."""
    return Schema(config, {**PANEL, **(own or {})}, PANEL_STATUSES, round_trip=True, **details)


def list_of(kinds: JsonType) -> Value:
    return Value(list, each=Value(kinds))


# What the experiments that sample rollouts (rollout, weight-update) record alike: the
# sampling (core/rollout.py: Sampling), a scorer as the config names it
# (backends/rollout.py: ScorerSpec, its model's digest and how it loads its precision),
# a sampled turn (Turn) and a scorer's pass over it (Scored).
SAMPLING = {
    "temperature": Value(NUMBER),
    "top_p": Value(NUMBER),
    "top_k": Value(int),
    "seed": Value(int),
    "logprobs": Value(str, values=LOGPROB_MODES),
    "max_tokens": Value(int),
    "ignore_eos": Value(bool),
}
SCORER = {
    "label": Value(str),
    "backend": Value((str, type(None))),
    "precision": Value((str, type(None))),
    "schedule": Value(str, values=SCHEDULES),
    "model": Value((str, type(None))),
    "model_digest": Value(str),
    "load": optional((str, type(None)), values=(*LOADS, None)),
}
MARGINS = Value((list, type(None)), each=Value(NUMBER, minimum=0))
TURN = {
    "token_ids": Value(list, each=TOKEN),
    "logprobs": list_of(NUMBER),
    "margins": MARGINS,
    "cached_tokens": Value((int, type(None)), minimum=0),
    "finish": Value(str),
}
SCORED = {
    "logprobs": list_of(NUMBER),
    "margins": MARGINS,
    "argmax_differs": Value((list, type(None)), each=Value(list, each=TOKEN)),
}


def temperature_problems(row: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """A sampled row's temperature against its config's sampling."""
    temperature = config["sampling"]["temperature"]
    if row["temperature"] == temperature:
        return []
    return [
        f"field temperature is {row['temperature']!r}, not the config's sampling "
        f"temperature {temperature!r}"
    ]
