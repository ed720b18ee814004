"""The run configuration: everything a worker needs to reproduce a row. Its result-affecting
part is the manifest's ``contract.run``, which audit and resume rebuild it from.

``RunSettings`` are the choices that pass unchanged from what the user asked for (the
runner's ``RunRequest``) into the configuration, so each is declared once, here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvreplay.backends import Backend, backend_from_contract, make_backend
from kvreplay.core.errors import KvreplayError
from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import StagePlan


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Where and how the model runs, decodes and is scored (keyword-only)."""

    device: str = "cpu"
    extractor: str = "integer"
    sampler: Sampler = field(default_factory=Sampler)
    chat: bool | None = None
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
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

    @classmethod
    def from_contract(
        cls, data: dict[str, Any], run_dir: str = "", connection: dict[str, Any] | None = None
    ) -> RunConfig:
        """Rebuild the configuration a run recorded (for audit and resume), its backend
        reached through ``connection`` (e.g. a server's address, which is not recorded)."""
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
                backend=backend_from_contract(data.get("backend"), connection),
                run_dir=run_dir,
            )
        except (KeyError, TypeError, KvreplayError) as exc:  # a hand-edited manifest
            raise KvreplayError(
                f"manifest.json: field contract.run is malformed ({type(exc).__name__}: {exc})"
            ) from exc

    def contract(self) -> dict[str, Any]:
        """The result-affecting part (paths and snapshot choice excluded)."""
        backend = self.backend.contract()
        return {
            **({"backend": backend} if backend is not None else {}),
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
