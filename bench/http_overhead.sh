#!/usr/bin/env bash
# Per-row time of matched over HTTP vs the in-process vllm backend (issue 26): a vllm serve
# of the embedded SmolLM2 with the in-process backend's engine settings (block 32, eager,
# one-chunk prefill, 8 sequences, seed 0, 1 GiB KV cache), then farm-bench pairing
# bench/http_overhead.py over HTTP (A) with the in-process engine (B), 3 pairs after a
# warm-up, each on the same N arith items. Each run's own figures go to /tmp/http-overhead-*.txt.
set -euo pipefail
N=${N:-6}
PORT=${PORT:-18500}
export OMP_NUM_THREADS=1
MODEL=$(.venv-vllm/bin/python -c "from kvreplay.model.sources import resolve_source; print(resolve_source('smollm2-135m')[0])")
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --block-size 32 \
  --enable-prefix-caching --max-num-seqs 8 --max-model-len 8192 --max-num-batched-tokens 8192 \
  --enforce-eager --seed 0 --enable-prompt-tokens-details > /tmp/vllm-serve-overhead.log 2>&1 &
pid=$!
trap 'kill $pid; wait $pid || true' EXIT
until curl -s -m 2 "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 5; done
rm -f /tmp/http-overhead-a.txt /tmp/http-overhead-b.txt
farm-bench -n 3 --timeout 3000 \
  --vs "sh -c 'exec .venv-vllm/bin/python bench/http_overhead.py --backend vllm --n $N >>/tmp/http-overhead-b.txt 2>/dev/null'" \
  -- sh -c "exec .venv-vllm/bin/python bench/http_overhead.py --backend http --url http://127.0.0.1:$PORT --n $N >>/tmp/http-overhead-a.txt 2>/dev/null"
grep '^{' /tmp/http-overhead-a.txt /tmp/http-overhead-b.txt
