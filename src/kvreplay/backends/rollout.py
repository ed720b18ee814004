"""Rollout stacks and scorers (design: rollout stack, scorer): the two roles a backend can
play in the mismatch audit, and how a run names and opens them.

A backend whose capabilities say ``rollout`` samples a conversation's turns at a
temperature and reports each sampled token's log-probability
(:meth:`~kvreplay.backends.base.Backend.rollout_stack`); one whose capabilities say
``scoring`` teacher-forces given token ids and reports each position's log-probability
of the given token (:meth:`~kvreplay.backends.base.Backend.scorer`), in one prefill (a
trainer's schedule) or, where it can, in the live schedule (``replay``: the prompt in
one chunk, then one token at a time; bit-exact with the stack's own decode, the pair
that must pass at the bit level). Each backend keeps its side in its own module
(``hf/rollout.py``, ``vllm/rollout.py``, ``llamacpp/rollout.py``,
``http/rollout.py``); this module
is the protocol and the spec grammar of ``--scorers``. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvreplay.backends.roles import Scorer
from kvreplay.core.cache import Recent
from kvreplay.core.canonical import sha256_json
from kvreplay.core.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.backends.base import Backend, ModelRef

OWN_PREFILL = "engine"  # the rollout stack's own prefill as a scorer; --scorers says engine
SCHEDULES = ("prefill", "replay")
MAX_SCORERS = 8  # each loads its model and scores every rollout


@dataclass(frozen=True)
class ScorerSpec:
    """One entry of ``--scorers``: ``engine`` (the rollout stack's own prefill) or
    ``BACKEND:PRECISION[:SCHEDULE][@MODEL]`` (another backend at a precision, in one
    prefill or the live ``replay`` schedule, on ``--model`` or the model named)."""

    backend: str | None
    precision: str | None = None
    schedule: str = "prefill"
    model: str | None = None

    @property
    def label(self) -> str:
        """How tables and sentences name the scorer."""
        if self.backend is None:
            return OWN_PREFILL if self.schedule == "prefill" else f"{OWN_PREFILL}:{self.schedule}"
        text = f"{self.backend}:{self.precision}"
        text += f":{self.schedule}" if self.schedule != "prefill" else ""
        return text + (f"@{self.model}" if self.model else "")

    @classmethod
    def parse(cls, text: str) -> ScorerSpec:
        """A spec from its text, checked against the backend registry (one sentence)."""
        from kvreplay.backends import backend_class

        body, _, model = text.strip().partition("@")
        parts = body.split(":")
        if parts[0] == OWN_PREFILL:
            if len(parts) > 2 or model:
                raise KvreplayError(f"--scorers entry {text!r}: write engine or engine:replay.")
            return cls(None, schedule=_schedule(parts[1] if len(parts) == 2 else "prefill", text))
        if len(parts) not in (2, 3) or not all(parts):
            raise KvreplayError(
                f"--scorers entry {text!r} is not engine or BACKEND:PRECISION[:SCHEDULE][@MODEL]"
                " (e.g. hf:fp32)."
            )
        backend = backend_class(parts[0])
        if not backend.capabilities.scoring:
            raise KvreplayError(f"The {parts[0]} backend cannot teacher-force token ids (score).")
        if parts[1] not in backend.precisions:
            raise KvreplayError(
                f"--scorers entry {text!r}: the {parts[0]} backend runs "
                f"{', '.join(backend.precisions)}, not {parts[1]}."
            )
        schedule = _schedule(parts[2] if len(parts) == 3 else "prefill", text)
        return cls(parts[0], parts[1], schedule, model or None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _schedule(name: str, text: str) -> str:
    if name not in SCHEDULES:
        raise KvreplayError(
            f"--scorers entry {text!r}: the schedule is {' or '.join(SCHEDULES)}, not {name!r}."
        )
    return name


def parse_scorers(text: str) -> list[ScorerSpec]:
    """``--scorers``: comma-separated specs, each once, at most :data:`MAX_SCORERS`."""
    parts = [part for part in text.split(",") if part.strip()]
    if len(parts) > MAX_SCORERS:
        raise KvreplayError(
            f"--scorers names {len(parts)} scorers; a run scores every rollout with each, so "
            f"it takes at most {MAX_SCORERS}."
        )
    specs = [ScorerSpec.parse(part) for part in parts]
    labels = [s.label for s in specs]
    repeated = next((label for label in labels if labels.count(label) > 1), None)
    if repeated is not None:
        raise KvreplayError(f"--scorers names {repeated} twice; list each scorer once.")
    return specs


LOADS = ("pretrained", "cast")
"""How a scorer may load its precision, where its backend has a choice
(:attr:`~kvreplay.backends.base.Backend.trainer_loads`)."""


_DIGESTS: Recent[tuple[str, str], str] = Recent(64)


def scorer_digest(spec: ScorerSpec, model: str) -> str:
    """The model digest of the files a scorer runs (its own model, or the run's), as its
    backend describes them; computed once per process while it is among the last used."""
    from kvreplay.backends import make_backend
    from kvreplay.model.identity import IDENTITY_SCHEME

    assert spec.backend is not None
    backend, files = spec.backend, spec.model or model
    return _DIGESTS.get(
        (backend, files),
        lambda: make_backend(backend).describe_model(files, IDENTITY_SCHEME)["model_digest"],
    )


def open_model(backend: Backend, model: ModelRef, precision: str, load: str | None = None) -> Any:
    """What a backend computes with at a precision: its served model where it serves
    requests (vllm, http), else its loaded model (hf, llamacpp), loaded as ``load`` says
    where the backend has a choice."""
    if backend.capabilities.cache_control:
        return backend.open_served(model, precision)
    if load is not None and load in backend.trainer_loads:
        return backend.load_trainer(model, precision, load)
    return backend.load_model(model, precision)


OPENED_MODELS = 4
"""Scorer models a process keeps open: a run's few scorers, not every one it ever met."""
_OPENED: Recent[str, Any] = Recent(OPENED_MODELS)


def _opened(backend: Backend, model: ModelRef, precision: str, load: str | None) -> Any:
    """One model per backend, settings, model files, precision and way of loading in a
    process: scoring every rollout of a run loads each scorer once."""
    key = sha256_json([backend.contract(), dataclasses.asdict(model), precision, load])
    return _OPENED.get(key, lambda: open_model(backend, model, precision, load))


def scorer_load(backend: str, load: str) -> str | None:
    """How a scorer of ``backend`` loads its precision when ``load`` is asked: ``load``
    where the backend has a choice (:attr:`Backend.trainer_loads`), else None (its one
    way), as a run's config records it."""
    from kvreplay.backends import backend_class

    return load if load in backend_class(backend).trainer_loads else None


def open_scorer(spec: ScorerSpec, model: ModelRef, load: str | None = None) -> Scorer:
    """The scorer a spec names over ``model`` (the run's, or the spec's own ``@MODEL``),
    at the spec's backend and precision, loaded as ``load`` says where the backend has a
    choice; the files it loads must be those the run recorded (``model.digest``)."""
    from kvreplay.backends import make_backend

    assert spec.backend is not None and spec.precision is not None, "engine: the stack's own"
    backend = make_backend(spec.backend)
    opened = _opened(backend, model, spec.precision, load)
    identity = getattr(opened, "identity", None)
    if identity is not None and not identity.matches(model.digest):
        raise KvreplayError(
            f"The scorer {spec.label} loaded model files whose digest differs from the run's."
        )
    return backend.scorer(opened, spec.schedule)
