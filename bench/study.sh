#!/usr/bin/env bash
# The full-scale study of issue 15 on the embedded SmolLM2 (hours of CPU). Resumable:
# run it again after an interruption and it continues where the ledger stops.
set -euo pipefail
OUT=${1:-results/smollm2-easy-n200}
export OMP_NUM_THREADS=1
kvreplay run matched      --items arith-easy --n 200 --out "$OUT"
kvreplay run fixed-prefix --items arith-easy --n 200 --out "$OUT"
kvreplay run bridge       --items arith-easy --n 24 --dtypes bf16 --out "$OUT"
kvreplay analyze "$OUT" && kvreplay report "$OUT"
