#!/usr/bin/env bash
# The n = 200 arith-easy study on llama.cpp: the embedded SmolLM2 GGUF as shipped (Q4_1
# weights), both KV-cache types (fp16 is llama.cpp's default, fp32), then the bridge and
# fixed-prefix (the fp16 live prefixes held fixed at both KV types: replay vs prefill).
# Resumable: run it again after an interruption and it continues where the ledger stops.
set -euo pipefail
OUT=${1:-results/llamacpp-smollm2-easy-n200}
export OMP_NUM_THREADS=1
kvreplay run matched --backend llamacpp --items arith-easy --n 200 --dtypes fp16,fp32 --out "$OUT"
kvreplay run bridge --backend llamacpp --items arith-easy --n 24 --dtypes fp16 --out "$OUT"
kvreplay run fixed-prefix --backend llamacpp --items arith-easy --n 200 --dtypes fp16,fp32 --out "$OUT"
kvreplay analyze "$OUT" && kvreplay report "$OUT"
