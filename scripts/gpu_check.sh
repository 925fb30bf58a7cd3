#!/usr/bin/env bash
# GPU checks in one device call: tests, compute-sanitizer (memcheck, racecheck, synccheck), benchmarks.
# Logs go to $OUT (or ./gpu_check_out), 8 files at most (the device tool returns 8); the last lines
# printed are the summary.
#   scripts/gpu_check.sh [warm|tests|sanitize|raceprobe|host|bench|backward|decode|varlen|modifiers|paper|firstcall|ab|smoke|tune|tune_wide|ring|ncu]...
# (warm: every kernel variant compiled into CuPy's cache at once, before a long test run)
#   (default: tests sanitize host bench; one call of 10 minutes holds about that much)
# Environment: PYTEST_ARGS (default: all of tests/; shell quoting kept, e.g. 'tests/x.py -k "a or b"'), PYTEST_WORKERS (pytest-xdist workers, 6), WARM_MATCH
# (warm only the variants whose names contain one of its comma-separated parts, e.g. sm90),
# BENCH_ARGS (extra options of the standard sweep; for the backward stage --deterministic adds deterministic=True's column), MODIFIERS_ARGS (of the modifiers suite, e.g. "--headdims 64,256 --dtypes bf16,fp16"), *_TIMEOUT per stage in seconds, SAN_TOOLS (the
# compute-sanitizer tools, default all three; SANITIZE_PARTS=fwd sweeps the forwards only; SAN_ARGS more options,
# e.g. "--kernel-name kns=cuflash_bwd_sm90" to check only those kernels), AB_BASE (the
# checkout the ab stage compares this one, or AB_NEW, with, e.g. a `git archive` of the previous
# commit carried in an ignored folder; AB_SIDES "BASE NEW NEW2 ..." compares several checkouts with
# the first in one rotation, each DIR[,VAR=VALUE...]; AB_PARTS narrows it, AB_ROUNDS sets its rounds, AB_WIDE_DTYPES the wide parts' dtypes).
# The MiniLM GPU test needs the model on the machine: run `python scripts/minilm_embed.py
# --write-fp16-copy` here first (writes the ignored .data/minilm, 45 MB) and name ".data" in the
# device call's carry list.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=${*:-tests sanitize host bench}
summary=()
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start ))s"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# FlashAttention-3 as a benchmark peer: a carried .wheels/flash_attn3_jax-*.whl (23 MB, fetched with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
# flash-attn3-jax -d .wheels`; name ".wheels" in the call's carry, not together with .data/minilm)
# is installed beside the machine's JAX, which then leaves GPU memory to CuPy.
if ls .wheels/flash_attn3_jax-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --target /tmp/fa3 .wheels/flash_attn3_jax-*.whl >"$OUT/fa3_install.log" 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fa3 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    && summary+=("fa3 wheel installed")
fi

# bench_stage NAME TIMEOUT ARGS...: one scripts/bench.py run, its table in $OUT/NAME.md, its log appended to bench.log.
bench_stage() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY scripts/bench.py "$@" --markdown "$OUT/$name.md" >>"$OUT/bench.log" 2>&1
  local rc=$?; summary+=("$name rc=$rc ($(elapsed))")
  cat "$OUT/$name.md" 2>/dev/null || tail -n 5 "$OUT/bench.log"
}

for stage in $stages; do
  case $stage in
    warm)
      timeout ${WARM_TIMEOUT:-180} $PY scripts/warm_kernels.py --threads ${WARM_THREADS:-16} --match "${WARM_MATCH:-}" >"$OUT/warm.log" 2>&1
      rc=$?; summary+=("warm rc=$rc ($(elapsed)): $(tail -n 1 "$OUT/warm.log")")
      tail -n 3 "$OUT/warm.log" ;;
    tests)
      workers=${PYTEST_WORKERS:-6}
      eval "pytest_args=(${PYTEST_ARGS:-tests})"  # (a -k expression with spaces stays one argument)
      # One BLAS thread per worker: the float64 references' matmuls in 16 workers x 16 OpenBLAS threads
      # would oversubscribe the 16 cores (TEST_BLAS_THREADS overrides).
      OMP_NUM_THREADS=${TEST_BLAS_THREADS:-1} OPENBLAS_NUM_THREADS=${TEST_BLAS_THREADS:-1} \
        timeout -s INT -k 30 ${TEST_TIMEOUT:-330} $PY -m pytest -q -m gpu -p no:cacheprovider --maxfail=40 --timeout=300 -rfEs --durations=25 \
        ${workers:+-n $workers} "${pytest_args[@]}" >"$OUT/tests.log" 2>&1
      rc=$?; summary+=("tests rc=$rc ($(elapsed)): $(tail -n 1 "$OUT/tests.log")")
      tail -n 30 "$OUT/tests.log" ;;
    sanitize)
      for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
        timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 3 ${SAN_ARGS:-} $PY scripts/sanitize_run.py \
          >"$OUT/sanitize_$tool.log" 2>&1
        rc=$?; summary+=("$tool rc=$rc ($(elapsed)): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -n 1)")
        tail -n 5 "$OUT/sanitize_$tool.log"
      done ;;
    raceprobe)  # whether racecheck takes an mbarrier handover for synchronisation (scripts/racecheck_probe.py)
      for form in default explicit named racy; do
        timeout 60 compute-sanitizer --tool racecheck $PY scripts/racecheck_probe.py $form >>"$OUT/raceprobe.log" 2>&1
        summary+=("raceprobe $form rc=$?: $(grep -E 'RACECHECK SUMMARY' "$OUT/raceprobe.log" | tail -n 1)")
      done
      grep -E "wrong reads|RACECHECK SUMMARY" "$OUT/raceprobe.log" ;;
    host)
      timeout ${HOST_TIMEOUT:-60} $PY scripts/bench.py --suite host >"$OUT/host.log" 2>&1
      rc=$?; summary+=("host rc=$rc: $(head -n 1 "$OUT/host.log")")
      cat "$OUT/host.log" ;;
    bench) bench_stage bench ${BENCH_TIMEOUT:-240} ${BENCH_ARGS:-} --plot "$OUT/bench.png" ;;
    backward) bench_stage backward ${BENCH_TIMEOUT:-240} --backward --headdims 64,96,128,192,256 --seqlens 4096,16384 ${BENCH_ARGS:-} ;;
    tune)  # Hopper forward tiles under measurement (docs/perf-notes.md h9, h13, h15): d64 with 3 consumers, d192 keys per tile
      { timeout ${TUNE_TIMEOUT:-150} $PY scripts/tune_fwd.py --headdims 64 --seqlen 1024,2048,16384 --sm90 128x2,96x2x3
        timeout ${TUNE_TIMEOUT:-150} $PY scripts/tune_fwd.py --headdims 192 --seqlen 1024,4096,16384 --sm90 96x2,80x2,64x2; } >"$OUT/tune.log" 2>&1
      rc=$?; summary+=("tune rc=$rc ($(elapsed))")
      tail -n 30 "$OUT/tune.log" ;;
    tune_wide)  # float32 / float64 forward tiles (issue 24, docs/perf-notes.md f12, f13, f18): a column split
      # with S shared (the 6th field 2), the 7th field float32's 3xTF32 chains of S and P V.  Session 31 settled
      # float32 d128-d192 and float64 d224/d256 (BENCHMARKS.md session 31, item 2); float32 d224 is unmeasured
      # (its 4-warp tile: 255 registers, 8 bytes of spill; the split with (3, 3) chains 28)
      { timeout ${TUNE_TIMEOUT:-200} $PY scripts/tune_fwd.py --dtype fp32 --headdims 224 --seqlen 4096 \
          --configs 64x32x4x1x0,64x32x8x1x0x2x22,64x32x8x1x0x2x33
        # float64 d64 (f17's profile: latency-bound with 2 warps a scheduler; session 31 measured 3 blocks an
        # SM and 32-row warp tiles slower): 64-key tiles, more independent exp2 chains a warp (NVRTC 13.0:
        # 255 registers, 32 bytes of spill on main, 40 with f17 + f19), against the kept 64 x 32
        timeout ${TUNE_TIMEOUT:-200} $PY scripts/tune_fwd.py --dtype fp64 --headdims 64 --seqlen 16384 \
          --configs 64x32x4x1x0,64x64x4x2x0; } >"$OUT/tune_wide.log" 2>&1
      rc=$?; summary+=("tune_wide rc=$rc ($(elapsed))")
      tail -n 30 "$OUT/tune_wide.log" ;;
    smoke)  # the Hopper kernels' exactness rows and their ablation columns (docs/perf-notes.md h7-h9)
      timeout ${SMOKE_TIMEOUT:-200} $PY scripts/sm90_smoke.py fwd >"$OUT/smoke.log" 2>&1
      rc=$?; summary+=("smoke rc=$rc ($(elapsed))")
      tail -n 25 "$OUT/smoke.log" ;;
    decode) bench_stage decode ${DECODE_TIMEOUT:-150} --suite decode ;;
    varlen) bench_stage varlen ${VARLEN_TIMEOUT:-90} --suite varlen ;;
    modifiers)  # issue 23: bias, key-padding mask, dropout against cuflash without them and the peers
      bench_stage modifiers ${MODIFIERS_TIMEOUT:-150} --suite modifiers ${MODIFIERS_ARGS:-}
      bench_stage modifiers_bwd ${MODIFIERS_TIMEOUT:-150} --suite modifiers --backward ${MODIFIERS_ARGS:-} ;;
    paper) bench_stage paper ${PAPER_TIMEOUT:-60} --suite paper ;;
    ring)  # issue 25 on a machine with 2+ GPUs (nvidia-h200-x2/x4): exactness, weak/strong scaling, transfers
      NCCL_NVLS_ENABLE=0 timeout ${RING_TIMEOUT:-420} $PY scripts/ring_scaling.py ${RING_ARGS:-} --markdown "$OUT/ring.md" \
        >"$OUT/ring.log" 2>&1
      rc=$?; summary+=("ring rc=$rc ($(elapsed))")
      cat "$OUT/ring.md" 2>/dev/null || tail -n 20 "$OUT/ring.log" ;;
    ncu)  # Nsight Compute on single forward/backward calls (scripts/ncu_case.py): NCU_CASES "D:SEQLEN[:causal][:varlen][:backward[:det]][:mask|:bias|:dropout][:fp32|:fp64] ..."
      : >"$OUT/ncu.txt"
      for case in ${NCU_CASES:-128:16384 128:16384:causal 64:16384 64:512:causal:varlen}; do
        IFS=: read -r d s flags <<<"$case"
        args="--headdim $d --seqlen $s"
        [[ $flags == *causal* ]] && args+=" --causal"
        [[ $flags == *varlen* ]] && args+=" --varlen"
        for m in mask bias dropout; do [[ $flags == *$m* ]] && args+=" --mods $m"; done
        kernel=cuflash_fwd_sm90
        [[ $flags == *backward* ]] && args+=" --backward" && kernel='cuflash_bwd_sm90.*dkdv'
        [[ $flags == *det* ]] && args+=" --deterministic"
        for t in fp32 fp64; do  # the float32/float64 kernels (sm_80 forms): both backward kernels
          [[ $flags == *$t* ]] && args+=" --dtype $t" && kernel="cuflash_fwd_$t" && [[ $flags == *backward* ]] && kernel="cuflash_bwd_$t"
        done
        echo "#### $case" >>"$OUT/ncu.txt"
        rep=/tmp/ncu_${case//:/_}
        timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k "regex:$kernel" --launch-skip ${NCU_SKIP:-3} --launch-count ${NCU_COUNT:-1} \
          --set ${NCU_SET:-full} --import-source no -f -o "$rep" $PY scripts/ncu_case.py $args >>"$OUT/ncu.txt" 2>&1
        summary+=("ncu $case rc=$? ($(elapsed))")
        ncu -i "$rep.ncu-rep" >>"$OUT/ncu.txt" 2>&1
        # NCU_SOURCE=1: executed instructions and stall samples per SASS instruction (the full set's
        # source counters), a CSV per case (docs/perf-notes.md h13 found the descriptor regression so)
        [[ ${NCU_SOURCE:-0} == 1 ]] && ncu -i "$rep.ncu-rep" --page source --print-source sass --csv \
          >"$OUT/ncu_src_${case//:/_}.csv" 2>>"$OUT/ncu.txt"
      done
      grep -E "^####|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Registers Per|Achieved Occupancy" \
        "$OUT/ncu.txt" | head -n 60 ;;
    firstcall)
      timeout ${FIRSTCALL_TIMEOUT:-240} $PY scripts/first_call.py --markdown "$OUT/firstcall.md" >"$OUT/firstcall.log" 2>&1
      rc=$?; summary+=("firstcall rc=$rc ($(elapsed))")
      cat "$OUT/firstcall.md" 2>/dev/null || tail -n 20 "$OUT/firstcall.log" ;;
    ab)  # checkouts against the first of AB_SIDES (or AB_BASE against AB_NEW), table in ab.md
      timeout ${AB_TIMEOUT:-420} $PY scripts/ab_compare.py ${AB_SIDES:-${AB_BASE:?set AB_BASE or AB_SIDES} ${AB_NEW:-.}} \
        --parts "${AB_PARTS:-fwd,bwd,decode,varlen,host}" --rounds ${AB_ROUNDS:-3} --markdown "$OUT/ab.md" >"$OUT/ab.log" 2>&1
      rc=$?; summary+=("ab rc=$rc ($(elapsed))")
      cat "$OUT/ab.md" 2>/dev/null; tail -n 5 "$OUT/ab.log" ;;
    *) summary+=("unknown stage $stage") ;;
  esac
done
printf '%s\n' "== summary ==" "${summary[@]}"
