#!/usr/bin/env bash
# One device call's work, for sessions with little GPU time: run from the repository root on the
# GPU machine. DEPS (default .device, an ignored folder carried with the call) holds cutlass.tgz and
# gtest.tgz (tests/gpu/device_build.sh says how they are made); OUT is the folder whose files come back.
#   STEP=full   full build (build-gpu), then every GPU test: the suite, the validation tests, the
#               cp.async producer (BSATTN_GPU_NO_TMA=1), memcheck and racecheck on a forward subset,
#               and the forward kernels' local-memory count in the SASS (must be 0)
#   STEP=peers  issue 14's forward rows and the backward rows against FlashAttention-4 in the same
#               process (needs build-gpu, and `bash .peers/a/fa4-peer.sh stage .peers` in the call before)
#   STEP=ab     bench libraries timed interleaved on issue 14's rows: LIBS="base.so[.xz] v1.so[.xz] ..."
#               (the first is the base; a copy of it is timed last, as the A/A), ONLY (row name
#               prefixes, comma-separated), ROUNDS
# Libraries for STEP=ab are best built on the development machine (BSATTN_GPU_DTYPES=bf16,
# BSATTN_GPU_HEAD_DIMS=128, target bsattn_bench) and carried xz-compressed (about 5 MB each).
set -u
DEPS=${DEPS:-.device}
OUT=${OUT:-/tmp/bsattn-device-session}
mkdir -p "$OUT"
T=build-gpu/tests/bsattn_gpu_test
LIB=build-gpu/bench/gpu/libbsattn_bench.so
log() { echo "[$(date +%H:%M:%S)] $*"; }
summary() { grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$1" | tr '\n' ' '; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

case "${STEP:-}" in
full)
  log "full build"
  bash tests/gpu/device_build.sh "$DEPS" build-gpu > "$OUT/build.log" 2>&1
  rc=$?
  tail -20 "$OUT/build.log"
  [ "$rc" = 0 ] || exit 1
  log "GPU tests"
  timeout 300 "$T" > "$OUT/gpu_tests.log" 2>&1
  echo "suite rc=$? $(summary "$OUT/gpu_tests.log")"
  grep -E '^\[  FAILED  \]' "$OUT/gpu_tests.log" | head -20
  timeout 120 "$(find build-gpu -name bsattn_validation_test -type f | head -1)" --gtest_filter='GpuValidation*' \
    > "$OUT/validation.log" 2>&1
  echo "validation rc=$? $(summary "$OUT/validation.log")"
  BSATTN_GPU_NO_TMA=1 timeout 120 "$T" --gtest_filter='GpuForward.*:GpuProxy*:GpuPaged.*:GpuDecode.*' \
    > "$OUT/no_tma.log" 2>&1
  echo "no TMA rc=$? $(summary "$OUT/no_tma.log")"
  subset='GpuForward.TwoWarpgroupTilesPairTheirRoutes:GpuForward.PersistentManyTiles:GpuRoutes.WorkOrder*'
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 "$T" \
    --gtest_filter="$subset:GpuDecode.SplitsMergeInClusters:GpuBackward.EveryFormatBf16D128" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 "$T" --gtest_filter="$subset" \
    > "$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)"
  cuobjdump -sass "$LIB" | awk '/Function : /{f=$3} f ~ /forward_kernel/ && /(LDL|STL)/{l[f]++}
    END{n=0; for (k in l) n++; print "forward kernels with local memory:", n}'
  ;;
peers)
  source .peers/b/fa4-peer.sh install .peers || exit 1
  log "forward, issue 14's rows"
  PYTHONUNBUFFERED=1 timeout 420 python3 bench/gpu/bench_forward.py --lib "$LIB" --rows issue14 --peers fa4,cudnn \
    --out "$OUT/forward.md" > "$OUT/forward.log" 2>&1
  echo "forward rc=$?"; cat "$OUT/forward.md"
  log "backward"
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_backward.py --lib "$LIB" --peers fa4 --out "$OUT/backward.md" \
    > "$OUT/backward.log" 2>&1
  echo "backward rc=$?"; cat "$OUT/backward.md"
  ;;
ab)
  mkdir -p /tmp/ab-libs
  libs=()
  for f in ${LIBS:?LIBS: the bench libraries to compare, base first}; do
    to=/tmp/ab-libs/${#libs[@]}.so
    case "$f" in *.xz) xz -dc "$f" > "$to" ;; *) cp "$f" "$to" ;; esac
    libs+=("$to")
  done
  cp "${libs[0]}" /tmp/ab-libs/aa.so
  log "A/B: $LIBS, then the base again (A/A)"
  PYTHONUNBUFFERED=1 timeout "${AB_TIMEOUT:-400}" python3 bench/gpu/bench_forward.py --lib "${libs[0]}" \
    --compare "${libs[@]:1}" /tmp/ab-libs/aa.so --rows issue14 --peers none --only "${ONLY:?ONLY: row prefixes}" \
    --rounds "${ROUNDS:-6}" --iters 40 > "$OUT/ab.log" 2>&1
  echo "ab rc=$?"
  grep -E ' bsattn |MISMATCH' "$OUT/ab.log"
  ;;
*)
  echo "STEP: full, peers or ab (see the header)"
  exit 2
  ;;
esac
log "done"
