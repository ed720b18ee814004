#!/usr/bin/env bash
# Run each argument (a shell command) side by side, each to its own log; print every log
# once all are done (the whole of a failed one's last 300 lines, the tail of the rest) and
# fail if any failed. The test suites use it on a two-core box: the hf suite beside the
# vLLM suite in `make test`, and CI's kernel-family run beside `make test`, one thread
# each, so that neither core waits on the other suite's engine start-ups.
set -uo pipefail
logs=$(mktemp -d)
pids=()
i=0
for command in "$@"; do
  bash -c "$command" > "$logs/$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
status=0
failed=()
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then failed+=(0); else failed+=(1); status=1; fi
done
for i in "${!pids[@]}"; do
  command=${*:$((i + 1)):1}
  if [ "${failed[$i]}" = 1 ]; then
    echo "=== FAILED: $command"
    tail -n 300 "$logs/$i.log"
  else
    echo "=== passed: $command"
    tail -n 5 "$logs/$i.log"
  fi
done
rm -rf "$logs"
exit $status
