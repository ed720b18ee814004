"""Tiny randomly initialised causal LMs with a byte-level tokenizer, saved as local
model folders: they load through the same path as a user's model and run in
milliseconds, yet still show bf16 prefill-vs-decode drift."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 320
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


def build(arch: str, seed: int = 0, layers: int = 3):
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_common(layers)))
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
