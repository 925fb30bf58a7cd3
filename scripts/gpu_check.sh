#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer (memcheck + racecheck), benchmark.
# Logs go to $OUT (or ./gpu_check_out), 8 files at most (the device tool returns 8); the last lines
# printed are the summary.
#   scripts/gpu_check.sh [tests|sanitize|bench|host]...   (default: all four)
# The MiniLM GPU test needs the model on the machine: run `python scripts/minilm_embed.py
# --write-fp16-copy` here first (writes the ignored .data/minilm, 45 MB) and name ".data" in the
# device call's carry list.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=${*:-tests sanitize bench host}
summary=()

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

for stage in $stages; do
  case $stage in
    tests)
      timeout ${TEST_TIMEOUT:-360} $PY -m pytest -q -m gpu -p no:cacheprovider --maxfail=40 --timeout=300 \
        ${PYTEST_ARGS:-tests} >"$OUT/tests.log" 2>&1
      rc=$?; summary+=("tests rc=$rc: $(tail -n 1 "$OUT/tests.log")")
      tail -n 30 "$OUT/tests.log" ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 $PY scripts/sanitize_run.py \
          >"$OUT/sanitize_$tool.log" 2>&1
        rc=$?; summary+=("$tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -n 1)")
        tail -n 5 "$OUT/sanitize_$tool.log"
      done ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} $PY scripts/bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" \
        --markdown "$OUT/bench.md" >"$OUT/bench.log" 2>&1
      rc=$?; summary+=("bench rc=$rc")
      cat "$OUT/bench.md" 2>/dev/null || tail -n 20 "$OUT/bench.log" ;;
    host)
      timeout ${HOST_TIMEOUT:-120} $PY scripts/bench.py --suite host >"$OUT/host.log" 2>&1
      rc=$?; summary+=("host rc=$rc: $(head -n 1 "$OUT/host.log")")
      cat "$OUT/host.log" ;;
  esac
done
printf '%s\n' "== summary ==" "${summary[@]}"
