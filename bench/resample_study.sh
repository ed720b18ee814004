#!/usr/bin/env bash
# The resample certificate of issue 14 on the embedded SmolLM2: the first 24 arith-easy
# items of the n = 200 study, 16 seeded samples per arm, one run folder per precision
# (bf16 first, so its certificate exists before fp32 finishes). Hours of CPU; resumable:
# run it again after an interruption. WORKERS=2 uses two processes.
set -euo pipefail
ROOT=${1:-results/smollm2-resample-n24}
export OMP_NUM_THREADS=1
for dtype in bf16 fp32; do
  kvreplay run resample --items arith-easy --plan instruct --n 24 --dtypes "$dtype" \
    --samples 16 --replica-samples 2 --temperature 0.7 --top-p 1.0 --seed 0 --margin 0.05 \
    --workers "${WORKERS:-1}" --out "$ROOT-$dtype"
  kvreplay analyze "$ROOT-$dtype" && kvreplay report "$ROOT-$dtype"
done
