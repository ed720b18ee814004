"""The rollout experiment's declared schema (design: declared schema): its manifest config,
every field of a row down to each turn's scores and controls, and what a row must say
of its config: the temperature and seeds it sampled with, a turn count and token cap,
the scorers the config names and no other, the controls a turn has, the follow-up each
later turn re-sends, and the cached prompt tokens a stack can have reused (in process,
exactly the tokens before the turn's own tail; a first turn or a miss, none). No torch.
"""

from __future__ import annotations

from typing import Any

from kvreplay.backends.rollout import OWN_PREFILL, ScorerSpec
from kvreplay.core.errors import KvreplayError
from kvreplay.core.rollout import LOGPROB_MODES, Sampling
from kvreplay.core.sampler import Sampler
from kvreplay.experiments.rollout.roll import BATCHED, MISS
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

# The bounds of a rollout's options (experiment.RolloutOptions declares them), which a
# recorded config is held to as well.
MAX_TOKENS = 2**17  # a turn's cap: the longest context windows served today
MAX_SAMPLES = 1024  # rollouts per item: a row holds them all
MAX_TURNS = 64
MAX_TOP_K = 2**20
MAX_COMPANIONS = 64

CONFIG = {
    "item_ids": list_of(str),
    "dtypes": list_of(str),
    "sampling": Value(dict, fields=SAMPLING),
    "seeds": list_of(int),
    "turns": Value(int),
    "followup": Value((str, type(None))),
    "followup_token_ids": list_of(int),
    "engine": Value(bool),
    "scorers": Value(list, each=Value(dict, fields=SCORER)),
    "companions": Value(int),
}
TURN_RECORD = {
    **TURN,
    "scores": Value(dict, each=Value(dict, fields=SCORED)),
    "controls": optional(
        dict, fields={MISS: optional(dict, fields=TURN), BATCHED: optional(dict, fields=TURN)}
    ),  # fmt: skip
    "followup_token_ids": optional(list, each=Value(int)),
}
ROW = {
    "temperature": Value(NUMBER),
    "prompt_token_ids": Value(list, each=TOKEN),
    "rollouts": Value(
        list,
        each=Value(
            dict,
            fields={"seed": Value(int), "turns": Value(list, each=Value(dict, fields=TURN_RECORD))},
        ),  # fmt: skip
    ),
}


def config_relations(config: dict[str, Any]) -> list[str]:
    """What a rollout config's own fields contradict: its seeds are the sampling seed on,
    a follow-up only with later turns, each scorer labelled as its spec names it."""
    problems = []
    sampling, seeds, turns = config["sampling"], config["seeds"], config["turns"]
    if not seeds or seeds != list(range(sampling["seed"], sampling["seed"] + len(seeds))):
        problems.append("seeds are not the sampling seed on, one per sample")
    later = turns > 1
    if later != bool(config["followup_token_ids"]) or later != (config["followup"] is not None):
        problems.append("turns and the follow-up disagree (a follow-up with later turns only)")
    for name, value, low, high in (
        ("turns", turns, 1, MAX_TURNS),
        ("seeds", len(seeds), 1, MAX_SAMPLES),
        ("sampling.max_tokens", sampling["max_tokens"], 1, MAX_TOKENS),
        ("sampling.top_k", sampling["top_k"], 0, MAX_TOP_K),
        ("companions", config["companions"], 0, MAX_COMPANIONS),
    ):
        if not low <= value <= high:
            problems.append(f"{name} is {value}, outside what a run takes ({low} to {high})")
    try:
        Sampling(**sampling).check(LOGPROB_MODES, "the run's")
        Sampler(sampling["temperature"], sampling["top_p"], seeds[-1] if seeds else 0)
    except KvreplayError as exc:
        problems.append(f"sampling is not one a run takes ({str(exc).rstrip('.')})")
    for scorer in config["scorers"]:
        spec = ScorerSpec(scorer["backend"], scorer["precision"], scorer["schedule"],
                          scorer["model"])  # fmt: skip
        if scorer["label"] != spec.label or scorer["label"] == OWN_PREFILL:
            problems.append(f"scorer {scorer['label']!r} is not labelled as its spec")
    return problems


def relations(row: dict[str, Any], config: dict[str, Any], backend: Any) -> list[str]:
    """What a rollout row says that its config contradicts (see the module docstring)."""
    problems = temperature_problems(row, config)
    seeds = [r["seed"] for r in row["rollouts"]]
    if seeds != config["seeds"]:
        problems.append(f"field rollouts[].seed is {seeds[:8]}, not the config's seeds")
    for index, rollout in enumerate(row["rollouts"]):
        where = f"field rollouts[{index}]"
        if len(rollout["turns"]) != config["turns"]:
            problems.append(f"{where}.turns holds {len(rollout['turns'])} turns, not the config's")
            continue
        problems += _turn_problems(row, rollout["turns"], config, backend, where)
    return problems


def _turn_problems(
    row: dict[str, Any], turns: list[dict[str, Any]], config: dict[str, Any], backend: Any,
    where: str,
) -> list[str]:  # fmt: skip
    """Each turn of one rollout against the config (its scorers, cap, follow-up and
    controls) and its cached tokens against what the stack could have reused."""
    scorers = {s["label"] for s in config["scorers"]} | (
        {OWN_PREFILL} if config["engine"] else set()
    )
    exact = backend is not None and not backend.capabilities.cached_token_report
    problems = []
    context = list(row["prompt_token_ids"])
    for number, turn in enumerate(turns):
        at = f"{where}.turns[{number}]"
        followup, reused = turn.get("followup_token_ids"), 0
        if number:  # in process, all but the last answer token and the follow-up is reused
            previous = turns[number - 1]["token_ids"]
            reused = len(context) + len(previous) - 1
            context += [*previous, *config["followup_token_ids"]]
        if followup != (config["followup_token_ids"] if number else None):
            problems.append(f"{at}.followup_token_ids is not the config's follow-up")
        if set(turn["scores"]) != scorers:
            problems.append(
                f"{at}.scores names {sorted(turn['scores'])}, not the config's scorers "
                f"{sorted(scorers)}"
            )
        if len(turn["token_ids"]) > config["sampling"]["max_tokens"]:
            problems.append(f"{at}.token_ids holds more tokens than the config's max_tokens")
        sides = [turn, *turn.get("controls", {}).values()]
        if any(
            s["margins"] is not None and len(s["margins"]) != len(s["token_ids"]) for s in sides
        ):
            problems.append(f"{at}.margins does not hold one gap per token")
        controls = set(turn.get("controls", {}))
        if controls != ({MISS} if number else {BATCHED} if config["companions"] else set()):
            problems.append(f"{at}.controls names {sorted(controls)}, not what the config runs")
        cached = turn["cached_tokens"]
        if (exact and cached != reused) or (cached or 0) > len(context):
            problems.append(
                f"{at}.cached_tokens is {cached}, which the {getattr(backend, 'name', 'run')} "
                "backend cannot have reused of this turn's prompt"
            )
        miss = turn.get("controls", {}).get(MISS)
        if exact and miss is not None and miss["cached_tokens"] != 0:
            problems.append(f"{at}.controls.miss.cached_tokens is not 0 (a miss reuses nothing)")
    return problems


SCHEMA = Schema(CONFIG, ROW, relations=relations, config_relations=config_relations)
