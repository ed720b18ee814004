"""Tiny randomly initialised causal LMs with a byte-level tokenizer, saved as local
model folders: they load through the same path as a user's model and run in
milliseconds.

Whether their bf16 prefill drifts from decode is a property of the CPU's kernel family:
with torch's portable kernels (``ATEN_CPU_CAPABILITY=default``) a tiny model's prefill
cache is usually bit-exact with live and no suffix diverged on 216 tries, while AVX-512
diverges on about one prompt in four. Tests of kvreplay's machinery (transplants, panels,
localisation) therefore use ``drift_qwen2``: the tiny Qwen2 with a registered forward
hook that makes any forward pass over more than ``DRIFT_CHUNK`` tokens (a prefill, never
a decode step) scale the embeddings of its inner positions by ``1 + DRIFT_SCALE``. It
stands in for a kernel whose prefill rounds differently from decode, and it does so the
same way on every CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 320
DRIFT_CHUNK = 40
DRIFT_SCALE = 0.5
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|eos|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _common(layers: int) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=256,
        bos_token_id=None,
        pad_token_id=256,
    )


def _drift(module: torch.nn.Module, _inputs: tuple, embeddings: torch.Tensor) -> torch.Tensor:
    """A prefill-only perturbation: inner positions of a long chunk (first and last kept)."""
    if embeddings.shape[1] <= DRIFT_CHUNK:
        return embeddings
    drifted = embeddings.clone()
    drifted[:, 1:-1] = (embeddings[:, 1:-1].float() * (1 + DRIFT_SCALE)).to(embeddings.dtype)
    return drifted


class DriftQwen2Config(Qwen2Config):
    model_type = "drift_qwen2"


class DriftQwen2ForCausalLM(Qwen2ForCausalLM):
    """Tiny Qwen2 whose prefill drifts from decode by construction (see the module doc)."""

    config_class = DriftQwen2Config

    def __init__(self, config: DriftQwen2Config):
        super().__init__(config)
        self.get_input_embeddings().register_forward_hook(_drift)


AutoConfig.register("drift_qwen2", DriftQwen2Config)
AutoModelForCausalLM.register(DriftQwen2Config, DriftQwen2ForCausalLM)


def build(arch: str, seed: int = 0, layers: int = 3):
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_common(layers)))
    if arch == "drift_qwen2":
        return DriftQwen2ForCausalLM(DriftQwen2Config(**_common(layers)))
    if arch == "served_qwen2":  # head size 32: the smallest vLLM's CPU attention serves
        return Qwen2ForCausalLM(
            Qwen2Config(**_common(layers) | {"num_attention_heads": 2, "num_key_value_heads": 1})
        )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**_common(layers)))
    if arch == "gemma3":
        config = Gemma3TextConfig(
            **_common(layers),
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        )
        return Gemma3ForCausalLM(config)
    raise ValueError(arch)


def save_tiny(folder: Path, arch: str, seed: int = 0) -> Path:
    """Write a tiny model folder (safetensors + tokenizer) and return it."""
    model = build(arch, seed)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return folder
