#!/usr/bin/env bash
# On a GPU machine: the GPU tests, compute-sanitizer (memcheck + racecheck) on a representative
# subset, the SASS checks (HGMMA in the kernels, no local memory) and the benchmark.
#   BUILD=build-gpu tests/gpu/device_check.sh            (build first: cmake -B build-gpu && cmake --build build-gpu)
# Env: BUILD (build dir), OUT (log dir), PEERS (all|core|none), STEPS (subset of "tests validation
# sanitize sass bench compare variants summaries"), COMPARE (other libbsattn_bench.so builds timed
# against this one, interleaved; COMPARE_ROWS, COMPARE_ONLY, COMPARE_ROUNDS choose the rows).
set -u
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-/tmp/bsattn-device-check}
PEERS=${PEERS:-all}
STEPS=${STEPS:-tests sanitize sass bench}
mkdir -p "$OUT"
T=$BUILD/tests/bsattn_gpu_test
LIB=$BUILD/bench/gpu/libbsattn_bench.so
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [[ " $STEPS " == *" tests "* ]]; then
  echo "== GPU tests"
  timeout ${TEST_TIMEOUT:-240} "$T" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|error|expected|Which is|bad" | head -60
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

if [[ " $STEPS " == *" validation "* ]]; then
  echo "== validation on the device"
  timeout 120 "$(find "$BUILD" -name bsattn_validation_test -type f | head -1)" --gtest_filter='GpuValidation*' \
    > "$OUT/validation.log" 2>&1
  [[ $? == 0 ]] || status=1
  grep -E '^\[  (PASSED|FAILED) ' "$OUT/validation.log"
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  echo "== compute-sanitizer"
  SUB='GpuForward.EveryFormatBf16D128:GpuForward.PersistentManyTiles:GpuForward.RouteOverflow:GpuRoutes.DeviceMatchesHost:GpuForward.GraphReplayWithChangedMetadata:GpuForward.TwoWarpgroupTilesPairTheirRoutes:GpuDecode.SplitsMergeInClusters:GpuBackward.EveryFormatBf16D128'
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$T" --gtest_filter="$SUB" > "$OUT/sanitizer.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 "$T" --gtest_filter='GpuForward.PersistentManyTiles' >> "$OUT/sanitizer.log" 2>&1
  echo "racecheck rc=$?: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  timeout 60 compute-sanitizer --tool synccheck --error-exitcode 3 "$T" --gtest_filter='GpuForward.LongerSequencesDense' >> "$OUT/sanitizer.log" 2>&1
  echo "synccheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
fi

if [[ " $STEPS " == *" sass "* ]]; then
  echo "== SASS"
  cuobjdump --dump-sass "$LIB" > "$OUT/sass.txt" 2>&1
  # Per forward-kernel function: HGMMA count and local-memory instructions (must be 0).
  awk '/Function : /{f=$3} f ~ /forward_kernel/ && /HGMMA/{h[f]++} f ~ /forward_kernel/ && /(LDL|STL)/{l[f]++} END{for (k in h) printf "%s HGMMA=%d LDL/STL=%d\n", k, h[k], l[k]+0}' "$OUT/sass.txt" | tee "$OUT/sass_summary.txt"
  gzip -f "$OUT/sass.txt"
fi

if [[ " $STEPS " == *" bench "* ]]; then
  echo "== benchmark"
  PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-400} python3 bench/gpu/bench_forward.py --lib "$LIB" --peers "$PEERS" --out "$OUT/bench.md" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^|" 
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ " $STEPS " == *" compare "* && -n "${COMPARE:-}" ]]; then
  echo "== interleaved comparison: $LIB | $COMPARE"
  PYTHONUNBUFFERED=1 timeout ${COMPARE_TIMEOUT:-300} python3 bench/gpu/bench_forward.py --lib "$LIB" --compare $COMPARE \
    --rows "${COMPARE_ROWS:-forward}" --peers none --only "${COMPARE_ONLY:-S32768,S16384}" --rounds "${COMPARE_ROUNDS:-6}" \
    --iters 40 2>&1 | tee "$OUT/compare.log" | grep -E " bsattn |MISMATCH|rror"
fi
if [[ " $STEPS " == *" variants "* ]]; then
  # The cp.async producer (no TMA) must stay correct; timing of the run-time variants (VARIANT_ONLY=none: no timing).
  echo "== variants"
  BSATTN_GPU_NO_TMA=1 timeout 120 "$T" --gtest_filter="GpuForward.*:GpuPaged.*" > "$OUT/gpu_tests_no_tma.log" 2>&1
  echo "tests without TMA rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/gpu_tests_no_tma.log" | head -3 | tr '\n' ' ')"
  # Split-KV decode merged through the workspace (where its clusters would fit, they merge in them).
  BSATTN_GPU_DECODE_CLUSTER=0 timeout 120 "$T" --gtest_filter="GpuDecode.*" > "$OUT/gpu_tests_no_cluster.log" 2>&1
  echo "decode tests without clusters rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/gpu_tests_no_cluster.log" | head -3 | tr '\n' ' ')"
  [[ ${VARIANT_ONLY:-S32768} == none ]] || for v in BSATTN_GPU_NO_TMA; do
    env $v=1 PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_forward.py --lib "$LIB" --peers none \
      --only ${VARIANT_ONLY:-S32768} 2>&1 | grep -E "^S[0-9]" | sed "s/^/$v=1 /"
  done
fi
if [[ " $STEPS " == *" summaries "* ]]; then
  # Proxy summaries (issue 11): tests, memcheck + racecheck on a subset, bandwidth vs 4.21 TB/s.
  echo "== summaries"
  S=$T
  timeout 120 "$S" --gtest_filter="*Summary*" > "$OUT/summary_tests.log" 2>&1
  [[ $? == 0 ]] || status=1
  echo "summary tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/summary_tests.log" | head -3 | tr '\n' ' ')"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 3 "$S" \
      --gtest_filter='Random/GpuSummaryTest.*/1?:GpuSummary.*' > "$OUT/summary_$tool.log" 2>&1
    echo "$tool rc=$?: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/summary_$tool.log" | tail -1)"
  done
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu/bench_summaries.py --lib "$LIB" --out "$OUT/summaries.md" 2>&1 |
    tee "$OUT/summaries.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
