"""The weight-update experiment's declared schema (design: declared schema): its manifest
config (the items, precisions, sampling, the update and when an in-flight rollout takes
it, the trainers) and every field of a row (the turns before and after the sync, the
miss, the in-flight rollout and each prefill of them), and what a row must say of its
config: the temperature it sampled at, the update point, a token cap every turn keeps,
one prefill value per token, the trainers the config names and no other. No torch.
"""

from __future__ import annotations

from typing import Any

from kvreplay.backends.rollout import OWN_PREFILL, ScorerSpec
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import LOGPROB_MODES, Sampling
from kvreplay.harness.schema import (
    NUMBER,
    SAMPLING,
    SCORED,
    SCORER,
    TOKEN,
    TURN,
    Schema,
    Value,
    list_of,
    optional,
    temperature_problems,
)
from kvreplay.model.update import PERTURB, WeightUpdate

MAX_TOKENS = 2**14  # a request's tokens: an update's stale cache shows in far fewer

UPDATE = {
    "spec": Value(str),
    "folder": Value((str, type(None))),
    "scale": Value(NUMBER, minimum=0),
    "seed": Value(int, minimum=0),
    "model_digest": Value((str, type(None))),
}
CONFIG = {
    "item_ids": list_of(str),
    "dtypes": list_of(str),
    "sampling": Value(dict, fields=SAMPLING),
    "update": Value(dict, fields=UPDATE),
    "update_at": Value(int, minimum=1),
    "scorers": Value(list, each=Value(dict, fields=SCORER)),
}
ROW = {
    "temperature": Value(NUMBER),
    "prompt_token_ids": Value(list, each=TOKEN),
    "update_at": Value(int, minimum=1),
    "before": Value(dict, fields=TURN),
    "after": Value(dict, fields=TURN),
    "miss": Value(dict, fields=TURN),
    "miss_prefill": Value(dict, fields=SCORED),
    "inflight": optional(dict, fields=TURN),
    "inflight_prefill": optional(dict, fields=SCORED),
    "inflight_scores": optional(dict, each=Value(dict, fields=SCORED)),
}
INFLIGHT = ("inflight", "inflight_prefill", "inflight_scores")


def config_relations(config: dict[str, Any]) -> list[str]:
    """What a weight-update config's own fields contradict: a sampling a run takes, an
    update point inside the request, the update as its spec names it, each trainer
    labelled as its spec and loaded in process."""
    problems = []
    sampling, update = config["sampling"], config["update"]
    if not 2 <= sampling["max_tokens"] <= MAX_TOKENS:
        problems.append(f"sampling.max_tokens is outside what a run takes (2 to {MAX_TOKENS})")
    elif not 0 < config["update_at"] < sampling["max_tokens"]:
        problems.append("update_at does not lie inside the request (1 to max_tokens less 1)")
    try:
        Sampling(**sampling).check(LOGPROB_MODES, "the run's")
    except KvreplayError as exc:
        problems.append(f"sampling is not one a run takes ({str(exc).rstrip('.')})")
    if update["spec"].startswith(PERTURB + ":"):
        try:
            parsed = WeightUpdate.parse(update["spec"]).to_dict()
        except KvreplayError:
            parsed = None
        recorded = {k: v for k, v in update.items() if k != "model_digest"}
        if parsed != recorded or update["model_digest"] is not None:
            problems.append("update is not the perturbation its spec names")
    elif update["folder"] is None or update["model_digest"] is None:
        problems.append("update names a folder without the folder and its digest")
    for scorer in config["scorers"]:
        spec = ScorerSpec(scorer["backend"], scorer["precision"], scorer["schedule"],
                          scorer["model"])  # fmt: skip
        if (
            scorer["label"] != spec.label
            or scorer["label"] == OWN_PREFILL
            or spec.model is not None
        ):
            problems.append(f"scorer {scorer['label']!r} is not a trainer labelled as its spec")
    return problems


def relations(row: dict[str, Any], config: dict[str, Any], backend: Any) -> list[str]:
    """What a weight-update row says that its config contradicts (see the module
    docstring)."""
    sampling = config["sampling"]
    problems = temperature_problems(row, config)
    if row["update_at"] != config["update_at"]:
        problems.append(f"field update_at is {row['update_at']!r}, not the config's")
    given = [key for key in INFLIGHT if key in row]
    if given and len(given) != len(INFLIGHT):
        problems.append("the in-flight rollout, its prefill and its trainers' scores go together")
        return problems
    for arm in ("before", "after", "miss", *INFLIGHT[:1]):
        turn = row.get(arm)
        if turn is None:
            continue
        if len(turn["token_ids"]) > sampling["max_tokens"]:
            problems.append(f"field {arm}.token_ids holds more tokens than the config's max_tokens")
        if turn["margins"] is not None and len(turn["margins"]) != len(turn["token_ids"]):
            problems.append(f"field {arm}.margins does not hold one gap per token")
    scored = [("miss_prefill", row["miss_prefill"], row["miss"])]
    if given:
        turn = row["inflight"]
        scored.append(("inflight_prefill", row["inflight_prefill"], turn))
        scored += [(f"inflight_scores.{k}", v, turn) for k, v in row["inflight_scores"].items()]
        trainers = {s["label"] for s in config["scorers"]}
        if set(row["inflight_scores"]) != trainers:
            problems.append(
                f"field inflight_scores names {sorted(row['inflight_scores'])}, not the "
                f"config's trainers {sorted(trainers)}"
            )
    for where, values, turn in scored:
        if len(values["logprobs"]) != len(turn["token_ids"]):
            problems.append(f"field {where}.logprobs does not hold one value per token")
    return problems


SCHEMA = Schema(CONFIG, ROW, relations=relations, config_relations=config_relations)
