#!/usr/bin/env bash
# The resample certificate of issue 14 on the embedded SmolLM2: the first 24 arith-easy
# items of the n = 200 study, 16 seeded samples per arm, bf16 and fp32 (hours of CPU).
# Resumable: run it again after an interruption. WORKERS=2 uses two processes.
set -euo pipefail
OUT=${1:-results/smollm2-resample-n24}
export OMP_NUM_THREADS=1
kvreplay run resample --items arith-easy --plan instruct --n 24 --dtypes bf16,fp32 \
  --samples 16 --replica-samples 2 --temperature 0.7 --top-p 1.0 --seed 0 --margin 0.05 \
  --workers "${WORKERS:-1}" --out "$OUT"
kvreplay analyze "$OUT" && kvreplay report "$OUT"
