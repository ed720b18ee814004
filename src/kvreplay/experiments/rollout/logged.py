"""Rollouts a framework already logged (design: mismatch): one JSON object per line,

    {"id": "step3/r17", "prompt_ids": [...], "response_ids": [...],
     "rollout_logprobs": [...], "trainer_logprobs": [...], "engine_logprobs": [...]}

``rollout_logprobs`` are what the sampler reported for each response token,
``trainer_logprobs`` what the trainer's teacher-forced pass computed, and the optional
``engine_logprobs`` the sampler's own prefill of the same sequence. kvreplay reads them
as rows of the rollout experiment (one turn each, filed under the precision ``logged``)
into the same metrics, claims and verdict as a run; given ``--rescore`` (the rollout
engine, e.g. ``vllm:bf16``, on ``--model``) it computes ``engine_logprobs`` itself with
the engine's own one-shot prefill, which splits the total into the engine's term and
the cross-stack term. Every line is checked before anything is computed: equal
lengths, token ids, finite log-probabilities at most 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.backends.rollout import ENGINE
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.paths import read_regular
from kvreplay.core.rollout import Scored, Turn

LOGGED = "logged"  # the precision logged rows are filed under
TRAINER = "trainer"
IDS = ("prompt_ids", "response_ids")
LOGPROBS = ("rollout_logprobs", "trainer_logprobs", "engine_logprobs")


def _line_problem(data: Any) -> str | None:
    """Why a parsed line is not a logged rollout, or None."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    missing = next((k for k in ("id", *IDS, *LOGPROBS[:2]) if k not in data), None)
    if missing is not None:
        return f"it has no {missing!r}"
    unknown = next((k for k in data if k not in ("id", *IDS, *LOGPROBS)), None)
    if unknown is not None:
        return f"it has a field {unknown!r} the format does not know"
    if not isinstance(data["id"], str) or not data["id"]:
        return "its 'id' is not a non-empty string"
    for key in IDS:
        ids = data[key]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            return f"its {key!r} is not a non-empty list of token ids"
    tokens = len(data["response_ids"])
    for key in (k for k in LOGPROBS if k in data):
        values = data[key]
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            return f"its {key!r} is not a list of numbers"
        if len(values) != tokens:
            return f"its {key!r} holds {len(values)} values for {tokens} response tokens"
        bad = next((v for v in values if not v <= 0), None)
        if bad is not None:
            return f"its {key!r} holds {bad!r}, not a log-probability (a number at most 0)"
    return None


def load_logged(path: Path) -> list[dict[str, Any]]:
    """The logged rollouts of a JSONL file as rollout rows; the first bad line is refused
    in one sentence naming it."""
    try:
        text = read_regular(path).decode("utf-8")
    except OSError as exc:
        raise KvreplayError(f"Cannot read the logged rollouts {path} ({exc.strerror}).") from None
    except UnicodeDecodeError:
        raise KvreplayError(f"The logged rollouts {path} are not UTF-8 text.") from None
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = parse_json(line)
        except JsonError as exc:
            raise KvreplayError(f"{path} line {number}: not valid JSON ({exc}).") from None
        problem = _line_problem(data)
        if problem is None and data["id"] in seen:
            problem = f"its id {data['id']!r} is used by an earlier line"
        if problem is not None:
            raise KvreplayError(f"{path} line {number}: {problem}.")
        seen.add(data["id"])
        rows.append(_row(data))
    if not rows:
        raise KvreplayError(f"{path} holds no logged rollout.")
    return rows


def _row(data: dict[str, Any]) -> dict[str, Any]:
    scores = {TRAINER: Scored([float(v) for v in data["trainer_logprobs"]]).to_dict()}
    if "engine_logprobs" in data:
        scores[ENGINE] = Scored([float(v) for v in data["engine_logprobs"]]).to_dict()
    turn = Turn(data["response_ids"], [float(v) for v in data["rollout_logprobs"]]).to_dict()
    return {
        "item_id": data["id"],
        "precision": LOGGED,
        "status": "ok",
        "temperature": 1.0,
        "prompt_token_ids": data["prompt_ids"],
        "rollouts": [{"seed": 0, "turns": [{**turn, "scores": scores}]}],
    }


def rescore(rows: list[dict[str, Any]], spec_text: str, model: str) -> None:
    """Score every row's response with the rollout engine's own one-shot prefill (the
    scorer ``spec_text`` names, on ``model``), as its ``engine`` side."""
    from kvreplay.backends import ModelRef, make_backend
    from kvreplay.backends.rollout import ScorerSpec, open_scorer
    from kvreplay.experiments.rollout.experiment import scorer_digest
    from kvreplay.model.reading import load_tokenizer, text_config, vocabulary_size
    from kvreplay.model.sources import canonical_spec

    spec = ScorerSpec.parse(spec_text)
    if spec.backend is None or spec.model is not None:
        raise KvreplayError(
            "--rescore names the rollout engine as BACKEND:PRECISION; --model its model."
        )
    model = canonical_spec(model)
    backend = make_backend(spec.backend)
    backend.check_installed()
    tokenizer = load_tokenizer(model)
    vocabulary = vocabulary_size(text_config(model), tokenizer)

    def largest(row: dict[str, Any]) -> int:
        return max(row["prompt_token_ids"] + row["rollouts"][0]["turns"][0]["token_ids"])

    outside = next((row["item_id"] for row in rows if largest(row) >= vocabulary), None)
    if outside is not None:
        raise KvreplayError(
            f"The logged rollout {outside} has a token id outside the vocabulary of {model} "
            f"({vocabulary}); --model must be the model that sampled it."
        )
    scorer = open_scorer(spec, ModelRef(model, scorer_digest(spec, model)))
    for row in rows:
        turn = row["rollouts"][0]["turns"][0]
        turn["scores"][ENGINE] = scorer.score(row["prompt_token_ids"], turn["token_ids"]).to_dict()
