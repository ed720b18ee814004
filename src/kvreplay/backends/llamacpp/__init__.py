"""The llamacpp backend: llama.cpp in this process, on a GGUF file as shipped (design:
backend protocol).

llama.cpp is reached through llama-cpp-python's ctypes binding (``make setup-llamacpp``
builds the library once from the pinned sdist). A run's precision is the KV-cache type
(``fp16`` is llama.cpp's default; ``q8_0`` needs flash attention and is compared
dequantized); the weights stay as quantized in the file. This module is the backend's
settings and checks; the model, its contexts and the boundary states in them are
:mod:`kvreplay.backends.llamacpp.runtime`, imported when a run needs them, so that naming
the backend (the registry, ``--help``) loads no torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvreplay.backends.base import Backend, Capabilities, ModelRef, option
from kvreplay.backends.llamacpp.binding import KV_TYPES, binding, check_kernels, system_info
from kvreplay.core.errors import KvreplayError

if TYPE_CHECKING:
    from pathlib import Path

    from kvreplay.backends.llamacpp.runtime import LlamaModel, Runtime


@dataclass(frozen=True)
class LlamaCppBackend(Backend):
    """llama.cpp's CPU build with the settings that can change a row's numerics."""

    name = "llamacpp"
    summary = "llama.cpp in this process on the GGUF as shipped; K/V from sequence state"
    capabilities = Capabilities(kv_access=True, seeded_sampling=True, rollout=True, scoring=True)
    precisions = tuple(KV_TYPES)
    prefix_precision = "fp16"  # llama.cpp's default KV-cache type
    extra = "llamacpp"
    requires = ("llama_cpp", "torch")
    libraries = {"llama_cpp_python": ("llama-cpp-python", "llama_cpp_python")}
    n_ctx: int = field(
        default=2048,
        metadata=option(
            "--n-ctx",
            "llama.cpp context size; every chunk is one micro-batch.",
            minimum=16,
            maximum=131072,
        ),
    )
    flash_attn: str = field(
        default="off", metadata=option("--flash-attn", "llama.cpp flash attention: on or off.")
    )

    def validate(self) -> None:
        if self.flash_attn not in ("on", "off"):
            raise KvreplayError("--flash-attn must be on or off.")

    def context_window(self, model_context: int) -> int:
        return min(model_context or self.n_ctx, self.n_ctx)

    def contract(self) -> dict[str, Any]:
        return {**super().contract(), "n_batch": self.n_ctx, "n_ubatch": self.n_ctx}

    def environment(self) -> dict[str, str]:
        return {"llama_cpp_python": importlib.metadata.version("llama-cpp-python")}

    def near_tie(self, precision: str) -> float:
        """The weights run as shipped (quantized): ggml's kernel families round their
        products differently whatever the KV-cache type (margins moved by up to 0.54 in
        fp32 between AVX-512 and AVX2; bench/results/cross_platform)."""
        return 1.0

    def kernels(self) -> str:
        """llama.cpp's system info: the kernel families its build compiled in."""
        return system_info()

    def installed(self) -> bool:
        if not super().installed():
            return False
        try:
            binding()
        except KvreplayError:
            return False
        return True

    def check_ready(self) -> None:
        check_kernels(system_info())

    def describe_model(self, spec: str, scheme: int, tokenizer: Any = None) -> dict[str, Any]:
        """The GGUF file llama.cpp runs is the model's identity, not a conversion of it."""
        from kvreplay.model.reading import describe_source, load_tokenizer

        tokenizer = tokenizer or load_tokenizer(spec)
        identity = gguf_identity(spec, tokenizer)
        return describe_source(spec, False, scheme, tokenizer, identity)

    def _runtime(self, path: Path, threads: int, kv: str, vocab_only: bool = False) -> Runtime:
        """llama.cpp's model in ``path``, making its contexts at this backend's settings."""
        from kvreplay.backends.llamacpp.runtime import Runtime

        return Runtime(path, self.n_ctx, self.flash_attn, threads, kv, vocab_only)

    def check_model(self, spec: str, device: str, dtypes: tuple[str, ...]) -> None:
        from kvreplay.model.sources import gguf_file

        if device != "cpu":
            raise KvreplayError("The llamacpp backend runs on --device cpu (its CPU build).")
        if "q8_0" in dtypes and self.flash_attn != "on":
            raise KvreplayError("llama.cpp quantizes the V cache only with --flash-attn on.")
        self._runtime(gguf_file(spec), threads=1, kv="fp16")  # refuses what llama.cpp cannot load

    def check_tokenization(
        self, spec: str, tokenizer: Any, prompts: list[Any], chat: bool | None
    ) -> None:
        """The token ids kvreplay feeds must be those llama.cpp makes of the same text."""
        from kvreplay.core.items import chat_messages, encode_prompt, is_token_ids
        from kvreplay.model.sources import gguf_file

        runtime = self._runtime(gguf_file(spec), threads=1, kv="fp16", vocab_only=True)
        for prompt in prompts:
            if is_token_ids(prompt):
                continue  # ids go to the engine as they are: nothing to tokenize
            messages = chat_messages(tokenizer, prompt, chat)
            text = (
                prompt
                if messages is None
                else tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            )
            theirs = runtime.tokenize(text, add_special=messages is None)
            if theirs != encode_prompt(tokenizer, prompt, chat):
                raise KvreplayError(
                    f"llama.cpp tokenizes a prompt of {spec!r} otherwise than the model's "
                    "tokenizer does, so its rows would feed ids llama.cpp never makes."
                )

    def load_model(
        self, model: ModelRef, precision: str, device_map: str | None = None
    ) -> LlamaModel:
        import torch

        from kvreplay.backends.llamacpp.runtime import LlamaModel
        from kvreplay.model.reading import describe_source, load_tokenizer
        from kvreplay.model.sources import gguf_file

        tokenizer = load_tokenizer(model.spec)
        identity = gguf_identity(model.spec, tokenizer)
        info = describe_source(model.spec, tokenizer=tokenizer, identity=identity)
        runtime = self._runtime(gguf_file(model.spec), torch.get_num_threads(), precision)
        window = self.context_window(int(info["context_length"]))
        return LlamaModel(runtime, tokenizer, model.spec, precision, identity, info, window)

    def rollout_stack(self, opened: Any) -> Any:
        from kvreplay.backends.llamacpp.rollout import rollout_stack

        return rollout_stack(opened)

    def rollout_logprobs(self) -> tuple[str, ...]:
        return ("raw", "processed")  # kvreplay samples from the logits and computes both

    def scorer(self, opened: Any, schedule: str = "prefill") -> Any:
        from kvreplay.backends.llamacpp.rollout import scorer

        return scorer(opened, schedule)


def gguf_identity(spec: str, tokenizer: Any) -> Any:
    """The :class:`~kvreplay.model.identity.ModelIdentity` of the GGUF file as shipped."""
    from kvreplay.model.identity import hash_model_files, model_identity
    from kvreplay.model.sources import gguf_file

    path = gguf_file(spec)
    return model_identity(hash_model_files(path.parent, path.name).result(), path.name, tokenizer)
