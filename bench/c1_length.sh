#!/usr/bin/env bash
# C1 of issue 15: how often does bf16 one-shot prefill continue differently from the
# token-by-token (replay) state on gemma3-270m, against prefix length? One fixed-prefix
# run per length on the trajectory items of bench/long_prefix_items.py (12 items each).
# Resumable: run it again and each ledger continues where it stops.
set -euo pipefail
ROOT=${1:-results/gemma3-length}
export OMP_NUM_THREADS=1
for L in ${LENGTHS:-256 1024}; do
  items=runs/long-$L.jsonl
  [ -s "$items" ] || python bench/long_prefix_items.py --model gemma3-270m --tokens "$L" --n 12 > "$items"
  kvreplay run fixed-prefix --model gemma3-270m --items "$items" --n 12 --dtypes bf16 \
    --out "$ROOT-$L"
  kvreplay analyze "$ROOT-$L" && kvreplay report "$ROOT-$L"
done
