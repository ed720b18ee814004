#!/usr/bin/env bash
# The ~1,000-token prefixes of the C1 length sweep on llama.cpp: the 12 gemma3-270m
# trajectory items of results/gemma3-length-1024 (made by bench/long_prefix_items.py),
# replay (token by token: the vector path) vs one-shot prefill (one micro-batch: the
# matrix path), on the embedded gemma3 GGUF as shipped (Q4_K_M), KV cache in bf16 as the
# transformers run. Resumable.
set -euo pipefail
OUT=${1:-results/llamacpp-gemma3-length-1024}
export OMP_NUM_THREADS=1
kvreplay run fixed-prefix --backend llamacpp --model gemma3-270m \
  --items results/gemma3-length-1024/items.jsonl --n 12 --dtypes bf16 --out "$OUT"
kvreplay analyze "$OUT" && kvreplay report "$OUT"
