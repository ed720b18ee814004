"""The run configuration: everything a worker needs to reproduce a row. Its result-affecting
part is the manifest's ``contract.run``, which audit and resume rebuild it from.

``RunSettings`` are the choices that pass unchanged from what the user asked for (the
runner's ``RunRequest``) into the configuration, so each is declared once, here, with
its command-line option (design: every option declared once)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvreplay.backends import Backend, ModelRef, backend_from_contract, make_backend
from kvreplay.contract.upgrade import current_run
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import option
from kvreplay.core.sampler import Sampler
from kvreplay.core.scoring import EXTRACTORS
from kvreplay.core.stages import StagePlan
from kvreplay.model.precision import parse_device


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Where and how the model runs, decodes and is scored (keyword-only); the backend
    carries its own settings."""

    device: str = field(
        default="cpu", metadata=option("--device", "cpu, cuda or cuda:N.", parse=parse_device)
    )
    extractor: str = field(
        default="integer",
        metadata=option("--extractor", "Answer extractor.", choices=tuple(EXTRACTORS)),
    )
    sampler: Sampler = field(default_factory=Sampler)
    chat: bool | None = field(
        default=None,
        metadata=option(
            "--chat",
            "Force the chat template on or off (default: use it if present).",
            negative="--no-chat",
        ),
    )
    backend: Backend = field(default_factory=make_backend)

    def settings(self) -> dict[str, Any]:
        """These settings alone, as keywords for another RunSettings."""
        return {f.name: getattr(self, f.name) for f in fields(RunSettings)}


@dataclass(frozen=True)
class RunConfig(RunSettings):
    """Everything a worker needs to reproduce a row; part of the manifest's contract."""

    model: str
    model_digest: str
    plan: StagePlan
    run_dir: str = ""
    save_snapshots: bool = False

    @property
    def model_ref(self) -> ModelRef:
        """The model as a backend opens it."""
        return ModelRef(self.model, self.model_digest, self.device)

    @classmethod
    def from_contract(
        cls, data: dict[str, Any], run_dir: str = "", connection: dict[str, Any] | None = None
    ) -> RunConfig:
        """Rebuild the configuration a run recorded (for audit and resume; an older layout
        read through :func:`~kvreplay.contract.upgrade.current_run`), its backend reached
        through ``connection`` (e.g. a server's address, which is not recorded)."""
        try:
            data = current_run(data)
            return cls(
                model=data["model"],
                model_digest=data["model_digest"],
                plan=StagePlan.from_dict(data["plan"]),
                device=data["device"],
                extractor=data["extractor"],
                sampler=Sampler(**data["sampler"]),
                chat=data["chat"],
                backend=backend_from_contract(data["backend"], connection),
                run_dir=run_dir,
            )
        except (KeyError, TypeError, AttributeError, KvreplayError) as exc:  # a hand-edited one
            raise KvreplayError(
                f"manifest.json: field contract.run is malformed ({type(exc).__name__}: {exc})"
            ) from exc

    def contract(self) -> dict[str, Any]:
        """The result-affecting part (paths and snapshot choice excluded)."""
        return {
            "backend": self.backend.contract(),
            "model": self.model,
            "model_digest": self.model_digest,
            "plan": self.plan.to_dict(),
            "device": self.device,
            "extractor": self.extractor,
            "sampler": asdict(self.sampler),
            "chat": self.chat,
        }
