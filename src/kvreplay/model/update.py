"""The weights a rollout engine is updated to mid-run (design: weight update arm), as an
RL step updates them: another checkpoint of the same model (a folder with the same
architecture and tokenizer), or the run's own weights moved by seeded noise
(``perturb:SCALE[:SEED]``: each floating tensor plus SCALE times its own standard
deviation times a standard normal drawn from SEED and the tensor's name, as one optimiser
step moves every weight a little). A perturbation is a function of the run's model and
the spec alone, so a run that used one re-executes anywhere, with no file beside it.

The new weights are read a tensor at a time, named as the checkpoint names them (what an
engine's own ``load_weights`` takes); a server reloads them from a folder written once
(:meth:`WeightUpdate.write`), and a trainer's model is moved to them in place
(:meth:`WeightUpdate.apply`)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError

PERTURB = "perturb"


@dataclass(frozen=True)
class WeightUpdate:
    """What an update loads: ``folder`` (another checkpoint) or a perturbation of the
    run's own weights by ``scale`` with ``seed``; ``spec`` as given."""

    spec: str
    folder: str | None = None
    scale: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> WeightUpdate:
        """``perturb:SCALE[:SEED]`` or a model folder; refused in one sentence."""
        if not text.startswith(PERTURB + ":"):
            folder = Path(text).expanduser()
            if not (folder / "config.json").is_file():
                raise KvreplayError(
                    f"--update {text}: not perturb:SCALE[:SEED] nor a model folder (no "
                    "config.json there)."
                )
            return cls(text, folder=str(folder))
        parts = text.split(":")
        try:
            scale = float(parts[1])
            seed = int(parts[2]) if len(parts) == 3 else 0
        except (ValueError, IndexError):
            scale, seed = -1.0, 0
        if len(parts) > 3 or not 0 < scale < 1 or seed < 0:
            raise KvreplayError(
                f"--update {text}: write perturb:SCALE[:SEED], SCALE in (0, 1) (the noise "
                "in units of each tensor's standard deviation), SEED a count."
            )
        return cls(text, scale=scale, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def source(self, model_folder: Path) -> Path:
        """The folder the new weights are read from."""
        return Path(self.folder) if self.folder is not None else model_folder

    def tensors(self, model_folder: Path) -> Iterator[tuple[str, Any]]:
        """The new weights, one tensor at a time, as the checkpoint names them (float32
        where perturbed; an engine casts them to its precision as it loads)."""
        import torch
        from safetensors import safe_open

        files = sorted(self.source(model_folder).glob("*.safetensors"))
        if not files:
            raise KvreplayError(f"No safetensors weights in {self.source(model_folder)}.")
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in sorted(handle.keys()):  # noqa: SIM118 - not a mapping
                    tensor = handle.get_tensor(name)
                    if self.folder is None and tensor.is_floating_point() and tensor.numel() > 1:
                        tensor = self._moved(name, tensor.float(), torch)
                    yield name, tensor

    def _moved(self, name: str, tensor: Any, torch: Any) -> Any:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        return tensor + self.scale * tensor.std() * noise

    def write(self, model_folder: Path, into: Path) -> Path:
        """A folder holding the new weights (one safetensors file) for a server to reload
        from; written once, then kept."""
        from safetensors.torch import save_file

        target = into / "model.safetensors"
        if not target.is_file():
            into.mkdir(parents=True, exist_ok=True)
            save_file(dict(self.tensors(model_folder)), str(into / "partial.safetensors"))
            (into / "partial.safetensors").rename(target)
        return into

    def apply(self, model: Any, model_folder: Path) -> None:
        """Move a loaded transformers model to the new weights in place (a trainer at the
        new step), each tensor cast to the parameter's own dtype."""
        import torch

        with torch.no_grad():
            for name, tensor in self.tensors(model_folder):
                try:
                    target = model.get_parameter(name)
                except AttributeError:
                    continue  # a tensor the model ties to another (lm_head to the embeddings)
                target.copy_(tensor.to(target.dtype))
