#!/usr/bin/env bash
# history (issue 38): the same hit after different histories of P's blocks (decoded, warm
# prefill, evicted) and under 4 loopback traffic clients, beside the miss, on the same 24
# arith items and plan as results/smollm2-http-n24-bf16 and results/llamacpp-server-n24-fp16:
# llama-server on the embedded SmolLM2 GGUF (f16 K/V, its default), 5 slots (the arm's and
# 4 traffic clients'), --metrics, and --cache-ram 0 (its host-memory prompt cache would
# otherwise restore an evicted slot); then vllm serve of the embedded SmolLM2 in bf16 with
# a small K/V pool (256 blocks of 32 tokens) so that an eviction is a few requests.
# Resumable (rerun it); each server is started and stopped here. KV=path of kvreplay.
set -euo pipefail
ROOT=${1:-results}
KV=${KV:-.venv/bin/kvreplay}
PY=$(dirname "$KV")/python
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
export OMP_NUM_THREADS=1
N=${N:-24}
TRAFFIC=${TRAFFIC:-4}

serve_until_up() { until curl -s -m 2 "$1/health" > /dev/null; do sleep 3; done; }

if [ -z "${SKIP_LLAMA:-}" ]; then
  PORT=${PORT_LLAMA:-18310}
  GGUF=$("$PY" -c "from kvreplay.model.embedded import EMBEDDED; print(EMBEDDED['smollm2-135m'].part_paths()[0])")
  build/llamacpp/cmake/bin/llama-server -m "$GGUF" --host 127.0.0.1 --port "$PORT" --threads 1 \
    --parallel $((TRAFFIC + 1)) --metrics --cache-ram 0 > /tmp/llama-server-history.log 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
  serve_until_up "http://127.0.0.1:$PORT"
  OUT=$ROOT/llamacpp-server-history-n$N-fp16
  "$KV" run history --backend http --url "http://127.0.0.1:$PORT" --n "$N" --dtypes fp16 \
    --companions 0 --traffic "$TRAFFIC" --out "$OUT"
  "$KV" audit "$OUT" --url "http://127.0.0.1:$PORT" --sample 2
  "$KV" analyze "$OUT" && "$KV" report "$OUT"
  kill $pid; wait $pid || true
fi

if [ -z "${SKIP_VLLM:-}" ]; then
  PORT=${PORT_VLLM:-18410}
  MODEL=$("$PY" -c "from kvreplay.model.sources import resolve_source; print(resolve_source('smollm2-135m')[0])")
  VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --enable-prompt-tokens-details \
    --block-size 32 --num-gpu-blocks-override 256 --max-model-len 2048 \
    > /tmp/vllm-serve-history.log 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
  serve_until_up "http://127.0.0.1:$PORT"
  OUT=$ROOT/smollm2-http-history-n$N-bf16
  "$KV" run history --backend http --url "http://127.0.0.1:$PORT" --n "$N" --dtypes bf16 \
    --traffic "$TRAFFIC" --out "$OUT"
  "$KV" audit "$OUT" --url "http://127.0.0.1:$PORT" --sample 2
  "$KV" analyze "$OUT" && "$KV" report "$OUT"
fi
