#!/usr/bin/env bash
# The llama.cpp server's prefix-cache hit vs miss over HTTP on the same 24 items and plan
# as results/smollm2-vllm-n24: llama-server (built by make setup-llamacpp) on the embedded
# SmolLM2 GGUF with its own defaults except one thread (a shared 2-core box) and the
# KV-cache type, fp16 (its default) then fp32, and --slot-save-path, so that the hit's
# replica continues from its live state saved and restored in the slot (cache-hit-restored).
# Each run is audited against its server.
# No companions: concurrent requests on other slots made the hit's later requests read
# no cached token on some items, and such rows do not re-execute identically.
set -euo pipefail
ROOT=${1:-results/llamacpp-server-n24}
export OMP_NUM_THREADS=1
SERVER=build/llamacpp/cmake/bin/llama-server
GGUF=$(python -c "from kvreplay.model.embedded import EMBEDDED; print(EMBEDDED['smollm2-135m'].part_paths()[0])")
PORT=${PORT:-18300}
SLOTS=$(mktemp -d)
for dtype in fp16 fp32; do
  case $dtype in fp16) kv=f16;; fp32) kv=f32;; esac
  "$SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" --threads 1 -ctk "$kv" -ctv "$kv" \
    --slot-save-path "$SLOTS/" > "/tmp/llama-server-$dtype.log" 2>&1 &
  pid=$!
  until curl -s -m 2 "http://127.0.0.1:$PORT/health" | grep -q ok; do sleep 1; done
  kvreplay probe --url "http://127.0.0.1:$PORT"
  kvreplay run matched --backend http --url "http://127.0.0.1:$PORT" --n 24 --dtypes "$dtype" --companions 0 \
    --out "$ROOT-$dtype"
  kvreplay audit "$ROOT-$dtype" --url "http://127.0.0.1:$PORT" --sample 2
  kvreplay analyze "$ROOT-$dtype" && kvreplay report "$ROOT-$dtype"
  kill "$pid"; wait "$pid" || true
done
rm -rf "$SLOTS"
