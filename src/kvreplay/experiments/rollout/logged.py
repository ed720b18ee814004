"""Rollouts a framework already logged (design: logged rollouts), read a line at a time
into the same metrics, claims and verdict as a run, whatever their length and number.

Three formats, told apart by their files' names (a folder is searched for them):

- **kvreplay's JSONL** (any other ``.jsonl``): one rollout a line,

      {"id": "step3/r17", "prompt_ids": [...], "response_ids": [...],
       "rollout_logprobs": [...], "trainer_logprobs": [...], "engine_logprobs": [...],
       "mask": [...], "step": 3, "rank": 0, "environment": "math",
       "rollout_temperature": 1.0, "rollout_logprobs_mode": "processed", ...}

  ``rollout_logprobs`` are what the sampler reported for each response token,
  ``trainer_logprobs`` what the trainer's teacher-forced pass computed, the optional
  ``engine_logprobs`` the sampler's own prefill of the same sequence; ``mask`` (1 or
  true: the token counts) leaves out padding and tool output; each side may say its
  temperature and which log-probability it holds (``raw`` or ``processed``).
- **prime-rl's token export**, schema 1 (``token_exports/step_N/rank_R.jsonl``, written
  by ``prime_rl/trainer/rl/token_export.py``): ``token_ids`` of the whole sequence,
  ``loss_mask``, ``inference_logprobs`` and ``trainer_logprobs`` aligned to the tokens
  (null where not finite), ``step``, ``rank``, ``env_name``.
- **NeMo-RL's training data** (``train_data_stepN.jsonl``, written by
  ``nemo_rl/algorithms/grpo.py``): ``token_ids`` padded to the batch, ``token_loss_mask``,
  ``sample_loss_mask``, ``generation_logprobs`` and ``prev_logprobs`` aligned to the
  tokens, ``input_lengths``; the step is the file's.

Pickled dumps (slime's ``.pt``, SkyRL's) are refused: loading a pickle runs its code.
Every line is checked as it is read (one sentence naming file and line): the fields,
equal lengths, token ids, finite log-probabilities at most 0 where the mask keeps a
token, each id once, of at most 200 characters and no control character. A line ends
at a newline only (a JSON string may hold U+2028, which ``str.splitlines`` would
split). Given a rescorer (the rollout engine's own one-shot prefill), the engine side is
computed as each rollout is read, which splits the total into the engine's term and the
cross-stack term.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvreplay.backends.rollout import OWN_PREFILL
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import MAX_ID_LENGTH
from kvreplay.core.jsonio import JsonError, parse_json_fast
from kvreplay.core.paths import open_regular
from kvreplay.core.rollout import LOGPROB_FLOOR, LOGPROB_MODES, ids_problem, logprobs_problem
from kvreplay.experiments.rollout.sides import Rollout, Side
from kvreplay.experiments.rollout.table import DECODE, PREFILL, ROLLOUT_SIDE

LOGGED = "logged"  # the group logged rollouts are filed under
TRAINER = "trainer"  # the trainer's side, as the verdict names it
KVREPLAY, PRIME_RL, NEMO_RL = "kvreplay", "prime-rl", "nemo-rl"
PRIME_FILE = re.compile(r"rank_(\d+)\.jsonl")
PRIME_FOLDER = re.compile(r"step_(\d+)")
NEMO_FILE = re.compile(r"train_data_step(\d+)\.jsonl")
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")
SIDES = ("rollout", "trainer", "engine")
KNOWN = (
    "id", "prompt_ids", "response_ids", "mask", "step", "rank", "environment",
    *(f"{side}_{what}" for side in SIDES for what in ("logprobs", "temperature", "logprobs_mode")),
)  # fmt: skip


@dataclass(frozen=True)
class LoggedFile:
    """One file of logged rollouts: its path, its format and the step its name gives
    (NeMo-RL's; None: the lines say, or no step)."""

    path: Path
    format: str
    step: int | None = None


def refuse_pickle(path: Path) -> None:
    """A pickle (``torch.save``, ``pickle.dump``) is refused, by its name or its first
    bytes, in one sentence that says how to convert it."""
    try:
        with open_regular(path) as handle:
            head = handle.read(4)
    except OSError:
        head = b""
    pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if path.suffix in PICKLE_SUFFIXES or pickled or head == b"PK\x03\x04":
        raise KvreplayError(
            f"{path} is a pickle (torch.save or pickle.dump), which kvreplay never loads: "
            "loading one runs whatever code it holds. Convert it in your own process: load "
            "it there and write one JSON object per rollout (prompt_ids, response_ids, "
            "rollout_logprobs, trainer_logprobs; docs/experiments/rollout.md, pickled dumps)."
        )


def file_format(path: Path) -> LoggedFile:
    """The format a file's name says."""
    if (nemo := NEMO_FILE.fullmatch(path.name)) is not None:
        return LoggedFile(path, NEMO_RL, int(nemo.group(1)))
    if PRIME_FILE.fullmatch(path.name) and PRIME_FOLDER.fullmatch(path.parent.name):
        return LoggedFile(path, PRIME_RL)
    return LoggedFile(path, KVREPLAY)


def logged_files(path: Path) -> list[LoggedFile]:
    """The files of logged rollouts a path names: a file, or every dump a folder holds
    by its framework's name (prime-rl's ``step_N/rank_R.jsonl``, NeMo-RL's
    ``train_data_stepN.jsonl``), in step order."""
    if path.is_dir():
        found = [
            file_format(p)
            for p in sorted(path.rglob("*.jsonl"))
            if NEMO_FILE.fullmatch(p.name)
            or (PRIME_FILE.fullmatch(p.name) and PRIME_FOLDER.fullmatch(p.parent.name))
        ]
        pickles = sorted(p for s in PICKLE_SUFFIXES for p in path.rglob(f"*{s}"))
        if not found and pickles:
            refuse_pickle(pickles[0])
        if not found:
            raise KvreplayError(
                f"The folder {path} holds no dump kvreplay reads by name (prime-rl's "
                "token_exports/step_N/rank_R.jsonl, NeMo-RL's train_data_stepN.jsonl); name "
                "a JSONL file of rollouts instead."
            )
        return sorted(found, key=lambda f: (_step_of(f), str(f.path)))
    refuse_pickle(path)
    return [file_format(path)]


def _step_of(file: LoggedFile) -> int:
    if file.step is not None:
        return file.step
    folder = PRIME_FOLDER.fullmatch(file.path.parent.name)
    return int(folder.group(1)) if folder else -1


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with open_regular(path) as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise KvreplayError(f"Cannot read the logged rollouts {path} ({exc.strerror}).") from None


class _Bad(Exception):
    """Why a line is not a logged rollout (the caller names file and line)."""


def _ids(data: dict[str, Any], key: str) -> np.ndarray:
    """Token ids, checked at numpy's speed; what fails is named by the one check of token
    ids every reader shares (:func:`kvreplay.core.rollout.ids_problem`)."""
    ids = data.get(key)
    found = np.full(1, -1)
    if isinstance(ids, list) and ids and set(map(type, ids)) <= {int}:
        try:
            found = np.asarray(ids, dtype=np.int64)
        except OverflowError:
            pass
    if (found < 0).any():
        problem = ids_problem(ids) or "is not a non-empty list of token ids (each below 2**63)"
        raise _Bad(f"its {key!r} {problem}")
    return found


def _numbers(data: dict[str, Any], key: str, length: int, nulls: bool = False) -> np.ndarray:
    """A list of numbers, one per token (null, where allowed, read as NaN)."""
    values = data.get(key)
    types = set(map(type, values)) if isinstance(values, list) else {dict}
    if not types <= {int, float, type(None)} or (type(None) in types and not nulls):
        problem = None if nulls else logprobs_problem(values, length)
        raise _Bad(f"its {key!r} {problem or 'is not a list of numbers'}")
    if len(values) != length:
        raise _Bad(f"its {key!r} holds {len(values)} values for {length} tokens")
    if type(None) in types:
        values = [np.nan if v is None else v for v in values]
    return np.asarray(values, dtype=np.float64).reshape(length)


def _logprobs(values: np.ndarray, kept: np.ndarray, key: str) -> np.ndarray:
    """Log-probabilities, each at most 0 and at least the floor where a token is kept."""
    bad = kept & ~((values >= LOGPROB_FLOOR) & (values <= 0))
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        value = values[index]
        shown = "null" if np.isnan(value) else repr(float(value))
        raise _Bad(
            f"its {key!r} holds {shown} at token {index}, not a log-probability (a finite "
            f"number at most 0 and at least {LOGPROB_FLOOR:.4g})"
        )
    return np.where(kept, values, 0.0)


def _mask(data: dict[str, Any], key: str, length: int) -> np.ndarray:
    values = data.get(key)
    if (
        not isinstance(values, list)
        or len(values) != length
        or not set(map(type, values)) <= {bool, int, float}
    ):
        raise _Bad(f"its {key!r} is not a list of one 0 or 1 per token")
    found = np.asarray(values, dtype=np.float64)
    if not ((found == 0.0) | (found == 1.0)).all():
        raise _Bad(f"its {key!r} is not a list of one 0 or 1 per token")
    return found == 1.0


def _count(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise _Bad(f"its {key!r} is not a count (an integer at least 0)")
    return value


def _mode(data: dict[str, Any], side: str) -> tuple[str | None, float | None]:
    mode, temperature = data.get(f"{side}_logprobs_mode"), data.get(f"{side}_temperature")
    if mode is not None and mode not in LOGPROB_MODES:
        raise _Bad(f"its '{side}_logprobs_mode' is {mode!r}, not raw or processed")
    if temperature is not None and (
        type(temperature) not in (int, float) or not 0 <= temperature < float("inf")
    ):
        raise _Bad(f"its '{side}_temperature' is not a temperature (a number at least 0)")
    return mode, None if temperature is None else float(temperature)


def _comparable(modes: dict[str, tuple[str | None, float | None]]) -> None:
    """Two sides compare only if they hold the same log-probability of the same
    distribution: both raw, or both processed at one temperature (or both at
    temperature 1, where the two are one)."""
    (a, (ma, ta)), *rest = modes.items()
    for b, (mb, tb) in rest:
        if ma is None or mb is None or (ma == mb == "raw"):
            continue
        if ta == tb == 1.0 or (ma == mb and ta == tb):
            continue
        said = {
            side: f"{m} log-probabilities" + (f" at temperature {t:g}" if t is not None else "")
            for side, (m, t) in ((a, (ma, ta)), (b, (mb, tb)))
        }
        raise _Bad(
            f"its {a} side holds {said[a]} and its {b} side {said[b]}: those are of different "
            "distributions; log both sides the same way (a trainer that divides its logits by "
            "the temperature computes processed ones)"
        )


def _kvreplay(data: dict[str, Any], file: LoggedFile) -> Rollout:
    missing = next((k for k in ("id", "prompt_ids", "response_ids", "rollout_logprobs",
                                "trainer_logprobs") if k not in data), None)  # fmt: skip
    if missing is not None:
        raise _Bad(f"it has no {missing!r}")
    unknown = next((k for k in data if k not in KNOWN), None)
    if unknown is not None:
        raise _Bad(f"it has a field {unknown!r} the format does not know")
    if not isinstance(data["id"], str) or not data["id"]:
        raise _Bad("its 'id' is not a non-empty string")
    prompt, response = _ids(data, "prompt_ids"), _ids(data, "response_ids")
    n = response.size
    mask = _mask(data, "mask", n) if "mask" in data else None
    every = np.ones(n, dtype=bool)
    modes = {side: _mode(data, side) for side in SIDES if f"{side}_logprobs" in data}
    _comparable(modes)
    sides: dict[str, Side] = {}
    for side, (mode, temperature) in modes.items():
        key = f"{side}_logprobs"
        values = _logprobs(_numbers(data, key, n), every, key)
        name = {"rollout": ROLLOUT_SIDE, "trainer": TRAINER, "engine": OWN_PREFILL}[side]
        kind = DECODE if side == "rollout" else PREFILL
        sides[name] = Side(kind, values, n, mode=mode, temperature=temperature)
    where = {
        k: v
        for k, v in (
            ("step", _count(data, "step")),
            ("rank", _count(data, "rank")),
            ("environment", _environment(data, "environment")),
        )
        if v is not None
    }
    return _rollout(data["id"], modes["rollout"][1], sides, mask, where, prompt, response)


def _environment(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _Bad(f"its {key!r} is not a string")
    return value or None


def _split(
    data: dict[str, Any], ids: np.ndarray, kept: np.ndarray, rollout: str, trainer: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Side]]:
    """A packed sequence (prompt and response in one list, a mask on the trained tokens)
    as a prompt and a response from its first kept token: the ids, the mask, the sides."""
    if not kept.any():
        raise _Bad("its mask keeps no token")
    first = int(np.flatnonzero(kept)[0])
    sides = {}
    for name, key, kind in ((ROLLOUT_SIDE, rollout, DECODE), (TRAINER, trainer, PREFILL)):
        values = _logprobs(_numbers(data, key, ids.size, nulls=True), kept, key)
        sides[name] = Side(kind, values[first:], ids.size - first)
    return ids[:first], ids[first:], kept[first:], sides


def _prime_rl(data: dict[str, Any], file: LoggedFile) -> Rollout:
    version = data.get("schema_version")
    if version != 1:
        raise _Bad(f"its schema_version is {version!r}; kvreplay reads prime-rl's token export 1")
    ids = _ids(data, "token_ids")
    kept = _mask(data, "loss_mask", ids.size)
    prompt, response, mask, sides = _split(
        data, ids, kept, "inference_logprobs", "trainer_logprobs"
    )
    step, rank = _count(data, "step"), _count(data, "rank")
    index = _count(data, "export_sequence_idx")
    run = data.get("run_id")
    key = f"{run + '/' if isinstance(run, str) else ''}step{step}/rank{rank}/{index}"
    where = {"step": step, "rank": rank, "environment": _environment(data, "env_name")}
    where = {k: v for k, v in where.items() if v is not None}
    return _rollout(key, None, sides, mask, where, prompt, response)


def _nemo_rl(data: dict[str, Any], file: LoggedFile) -> Rollout | None:
    ids = _ids(data, "token_ids")
    kept = _mask(data, "token_loss_mask", ids.size)
    sample = data.get("sample_loss_mask", 1)
    if sample not in (0, 1) or type(sample) not in (bool, int, float):
        raise _Bad("its 'sample_loss_mask' is not 0 or 1")
    length = _count(data, "input_lengths")
    if length is not None:
        if length > ids.size:
            raise _Bad(f"its 'input_lengths' ({length}) exceeds its {ids.size} token ids")
        kept[length:] = False  # padding
    if not sample or not kept.any():
        return None  # a sample NeMo-RL trains on no token of: not compared
    prompt, response, mask, sides = _split(data, ids, kept, "generation_logprobs", "prev_logprobs")
    index = _count(data, "idx")
    where = {"step": file.step} if file.step is not None else {}
    return _rollout(f"step{file.step}/{index}", None, sides, mask, where, prompt, response)


def _rollout(
    key: str,
    temperature: float | None,
    sides: dict[str, Side],
    mask: np.ndarray | None,
    where: dict[str, Any],
    prompt: np.ndarray,
    response: np.ndarray,
) -> Rollout:
    if mask is not None and not mask.any():
        raise _Bad("its mask keeps no token")
    if len(key) > MAX_ID_LENGTH or any(unicodedata.category(c) == "Cc" for c in key):
        raise _Bad(
            f"its id is longer than {MAX_ID_LENGTH} characters or holds a control character "
            "(no CSV line or XML attribute carries one as given)"
        )
    return Rollout(key, LOGGED, temperature, sides, mask, where, (prompt, response))


READERS: dict[str, Callable[[dict[str, Any], LoggedFile], Rollout | None]] = {
    KVREPLAY: _kvreplay,
    PRIME_RL: _prime_rl,
    NEMO_RL: _nemo_rl,
}


def read_logged(path: Path) -> Iterator[Rollout]:
    """The logged rollouts a file or folder holds (:func:`logged_files`), one at a time,
    each line checked as it is read; the first bad line is refused in one sentence
    naming it. A NeMo-RL sample whose masks keep no token is left out, as NeMo-RL
    leaves it out of its training step."""
    seen: set[bytes] = set()
    count = 0
    for file in logged_files(path):
        reader = READERS[file.format]
        for number, line in _lines(file.path):
            try:
                data = parse_json_fast(line)
            except JsonError as exc:
                raise KvreplayError(f"{file.path} line {number}: not valid JSON ({exc}).") from None
            try:
                if not isinstance(data, dict):
                    raise _Bad("it is not a JSON object")
                rollout = reader(data, file)
            except _Bad as problem:
                raise KvreplayError(f"{file.path} line {number}: {problem}.") from None
            if rollout is None:
                continue
            digest = hashlib.blake2b(rollout.key.encode(), digest_size=16).digest()
            if digest in seen:
                raise KvreplayError(
                    f"{file.path} line {number}: its id {rollout.key!r} is used by an earlier line."
                )
            seen.add(digest)
            count += 1
            yield rollout
    if not count:
        raise KvreplayError(f"{path} holds no logged rollout.")


ENGINE_GUARD = 1.0
"""Nats: where a rescored rollout's engine side lies further than this from the
sampler's on average (a model's own prefill differs from its decode by a few hundredths),
the ids are not the rescoring model's (another tokenizer, another model), and the
rescoring is refused."""
GUARD_TOKENS = 8  # the fewest kept tokens the guard judges a rollout on


class Rescorer:
    """The rollout engine's own one-shot prefill (``BACKEND:PRECISION`` on ``model``) as
    the engine side of each logged rollout, computed as it is read."""

    def __init__(self, spec_text: str, model: str):
        from kvreplay.backends import ModelRef, make_backend
        from kvreplay.backends.rollout import ScorerSpec, open_scorer, scorer_digest
        from kvreplay.model.reading import load_tokenizer, text_config, vocabulary_size
        from kvreplay.model.sources import canonical_spec

        spec = ScorerSpec.parse(spec_text)
        if spec.backend is None or spec.model is not None:
            raise KvreplayError(
                "--rescore names the rollout engine as BACKEND:PRECISION; --model its model."
            )
        self.model = canonical_spec(model)
        backend = make_backend(spec.backend)
        backend.check_installed()
        self.vocabulary = vocabulary_size(text_config(self.model), load_tokenizer(self.model))
        reference = ModelRef(self.model, scorer_digest(spec, self.model))
        self.scorer = open_scorer(spec, reference, "pretrained")

    def __call__(self, rollout: Rollout) -> Rollout:
        assert rollout.ids is not None, "a logged rollout carries its ids"
        prompt, response = rollout.ids
        own = rollout.sides[ROLLOUT_SIDE]
        if own.mode == "processed" and own.temperature != 1.0:
            raise KvreplayError(
                f"The logged rollout {rollout.key} holds processed log-probabilities at "
                f"temperature {own.temperature}, and --rescore computes raw ones: they would "
                "not compare."
            )
        if max(int(prompt.max()), int(response.max())) >= self.vocabulary:
            raise KvreplayError(
                f"The logged rollout {rollout.key} has a token id outside the vocabulary of "
                f"{self.model} ({self.vocabulary}); --model must be the model that sampled it."
            )
        scored = self.scorer.score(prompt.tolist(), response.tolist())
        engine = np.asarray(scored.logprobs, dtype=np.float64)
        kept = rollout.kept([ROLLOUT_SIDE])
        gap = float(np.mean(np.abs(engine[kept] - own.logprobs[kept]))) if kept.size else 0.0
        if kept.size >= GUARD_TOKENS and gap > ENGINE_GUARD:
            raise KvreplayError(
                f"Rescored by {self.model}, the logged rollout {rollout.key}'s tokens lie "
                f"{gap:.3g} nats a token from the sampler's log-probabilities on average "
                f"(a model's own prefill lies a few hundredths away): its ids are not this "
                "model's (another tokenizer or model); --model must be the model that sampled it."
            )
        margins = None if scored.margins is None else np.asarray(scored.margins)
        side = Side(PREFILL, engine, response.size, margins, scored.argmax_differs)
        return replace(rollout, sides={**rollout.sides, OWN_PREFILL: side})
