#!/usr/bin/env bash
# Re-derive every committed run under results/ without executing a model, and compare
# bytes with what is committed; prints PASS or FAIL per run, exit 1 if any failed.
#
#   kvreplay analyze RUN -o SCRATCH/claims.json    vs RUN/claims.json
#   kvreplay report RUN -o SCRATCH/                vs RUN/report.md, report.html, figures/
#   kvreplay audit RUN --sample 0 --threads N      the hash chain, every CSV (re-derived
#                                                  from rows.jsonl), claims, report, figures
#
# The audit refuses an environment whose libraries differ from the run's: a vLLM run is
# audited with VPY. An http run's audit needs its server (--url), so it is skipped there;
# analyze still re-derives the run's CSVs from rows.jsonl and refuses any that differ.
#
# Usage, from the repository root: bench/rederive_all.sh [RUN_DIR ...]
#   PY   the hf environment's Python (default .venv/bin/python)
#   VPY  the vLLM environment's Python (default .venv-vllm/bin/python)
set -u
PY=${PY:-.venv/bin/python}
VPY=${VPY:-.venv-vllm/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

kvreplay() {
  local python=$1
  shift
  "$python" -c 'import sys; from kvreplay.cli import main; sys.argv[0] = "kvreplay"; main()' "$@"
}

note() {  # note PROBLEM: remember one problem of the run
  problems+=("$1")
}

compare() {  # compare COMMITTED DERIVED: byte-identical, or a problem named
  cmp -s "$1" "$2" || note "${1#"$run"/} differs"
}

runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(results/*/)
failed=0
for run in "${runs[@]}"; do
  run=${run%/}
  [ -f "$run/manifest.json" ] || continue
  out="$scratch/$(basename "$run")"
  mkdir -p "$out/report"
  problems=()
  if [ -f "$run/claims.json" ]; then
    if kvreplay "$PY" analyze "$run" -o "$out/claims.json" >"$out/analyze.log" 2>&1; then
      compare "$run/claims.json" "$out/claims.json"
    else
      note "analyze failed: $(tail -n 1 "$out/analyze.log")"
    fi
  fi
  if [ -f "$run/report.md" ]; then
    if kvreplay "$PY" report "$run" -o "$out/report" >"$out/report.log" 2>&1; then
      for file in "$run"/report.md "$run"/report.html "$run"/figures/*.png; do
        [ -f "$file" ] && compare "$file" "$out/report/${file#"$run"/}"
      done
    else
      note "report failed: $(tail -n 1 "$out/report.log")"
    fi
  fi
  read -r backend threads < <("$PY" -c 'import json, sys
contract = json.load(open(sys.argv[1]))["contract"]
backend = contract["run"].get("backend")
name = backend.get("name", "hf") if isinstance(backend, dict) else "hf"
print(name, contract["environment"].get("threads") or 1)' "$run/manifest.json")
  audit="audited"
  if [ "$backend" = http ]; then
    audit="audit skipped: it needs the server"
  else
    python=$PY
    [ "$backend" = vllm ] && python=$VPY
    if ! kvreplay "$python" audit "$run" --sample 0 --threads "$threads" >"$out/audit.log" 2>&1; then
      note "audit: $(grep -m 1 -v '^environment\|^audit of\|^rows in' "$out/audit.log")"
    fi
  fi
  if [ ${#problems[@]} -eq 0 ]; then
    echo "PASS $run ($audit)"
  else
    failed=1
    echo "FAIL $run: $(printf '%s; ' "${problems[@]}")"
  fi
done
exit $failed
