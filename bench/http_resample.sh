#!/usr/bin/env bash
# resample over HTTP (issue 26): vllm serve of the embedded SmolLM2 with vLLM's own server
# defaults plus what kvreplay needs (VLLM_SERVER_DEV_MODE=1, --enable-prompt-tokens-details),
# the same 24 arith-easy items, plan, seeds and K as results/smollm2-vllm-resample-n24-bf16.
# Resumable; the server is started and stopped here.
set -euo pipefail
DTYPE=${DTYPE:-bf16}
OUT=${1:-results/smollm2-http-resample-n24-$DTYPE}
PORT=${PORT:-18400}
export OMP_NUM_THREADS=1
case $DTYPE in bf16) served=bfloat16;; fp32) served=float32;; esac
MODEL=$(.venv/bin/python -c "from kvreplay.model.sources import resolve_source; print(resolve_source('smollm2-135m')[0])")
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$served" --enable-prompt-tokens-details \
  > "/tmp/vllm-serve-$DTYPE.log" 2>&1 &
pid=$!
trap 'kill $pid; wait $pid || true' EXIT
until curl -s -m 2 "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 5; done
.venv/bin/kvreplay run resample --backend http --url "http://127.0.0.1:$PORT" --items arith-easy \
  --plan instruct --n 24 --dtypes "$DTYPE" --samples 16 --replica-samples 2 --temperature 0.7 \
  --top-p 1.0 --seed 0 --margin 0.05 --out "$OUT"
.venv/bin/kvreplay audit "$OUT" --url "http://127.0.0.1:$PORT" --sample 1
.venv/bin/kvreplay analyze "$OUT" && .venv/bin/kvreplay report "$OUT"
