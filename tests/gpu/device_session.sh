#!/usr/bin/env bash
# One device call's work, for sessions with little GPU time: run from the repository root on the
# GPU machine. DEPS (default .device, an ignored folder carried with the call) holds cutlass.tgz and
# gtest.tgz (tests/gpu/device_build.sh says how they are made); OUT is the folder whose files come back.
#   STEP=full   full build (build-gpu), then device_check.sh's tests, validation, sanitize, sass and
#               variants steps (the cp.async producer's tests; no timing)
#   STEP=prebuilt  the same checks on binaries built on the development machine and carried in
#               PREBUILT (default .device/bin: tests/gpu/pack_prebuilt.sh makes it), so that the call
#               compiles nothing; STEPS overrides device_check.sh's steps (e.g. "tests" alone)
#   STEP=peers  issue 14's forward rows and the backward rows against FlashAttention-4 in the same
#               process (needs build-gpu, and `bash .peers/a/fa4-peer.sh stage .peers` in the call before);
#               the forward rows with --power (settled clocks, power, back-to-back TF/s); PEER_LIB
#               (a bench library, .xz or not, e.g. quick_libs.sh with HEAD_DIMS="64;128;256") instead
#               of build-gpu's, so that the call needs no full build
#   STEP=ab     bench libraries timed interleaved on issue 14's rows (device_check.sh's compare step):
#               LIBS="base.so[.xz] v1.so[.xz] ..." (the first is the base; a copy of it is timed last,
#               as the A/A), ONLY (row name prefixes, comma-separated), ROUNDS
#   STEP=bwd-ab the same for the backward (bench_backward.py --compare, without its S 1024 check of
#               D 64 and 256, which quick builds lack): LIBS, ROWS (its row names,
#               default causal,rand0.25,rand1.0), ROUNDS
#   STEP=paged-ab  bench_paged.py per library of LIBS, alternated for ROUNDS (default 2) rounds
#   STEP=proxy-ab  the same with bench_proxy.py (proxy overhead over the exact run); BENCH_ARGS go to
#                  the benchmark (e.g. "--blocks 128x64")
# Libraries for STEP=ab are best built on the development machine (BSATTN_GPU_DTYPES=bf16,
# BSATTN_GPU_HEAD_DIMS=128, target bsattn_bench; tests/gpu/quick_libs.sh base=REV v1=REV) and
# carried xz-compressed (about 5 MB each).
set -u
DEPS=${DEPS:-.device}
export OUT=${OUT:-/tmp/bsattn-device-session}
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*"; }
# unpack SRC DST: a carried bench library to DST (xz-decompressed where SRC ends in .xz).
unpack() {
  case "$1" in *.xz) xz -dc "$1" > "$2" ;; *) [ "$1" -ef "$2" ] || cp "$1" "$2" ;; esac
}

case "${STEP:-}" in
full)
  log "full build"
  bash tests/gpu/device_build.sh "$DEPS" build-gpu > "$OUT/build.log" 2>&1
  rc=$?
  tail -20 "$OUT/build.log"
  [ "$rc" = 0 ] || exit 1
  log "tests"
  BUILD=build-gpu STEPS="tests validation sanitize sass variants" VARIANT_ONLY=none bash tests/gpu/device_check.sh
  ;;
prebuilt)
  dir=${PREBUILT:-.device/bin}
  log "prebuilt binaries of $(cat "$dir/REV" 2>/dev/null || echo '?')"
  mkdir -p build-gpu/tests build-gpu/bench/gpu
  unpack "$dir/gpu_test.xz" build-gpu/tests/bsattn_gpu_test
  [ -f "$dir/validation_test.xz" ] && unpack "$dir/validation_test.xz" build-gpu/tests/bsattn_validation_test
  [ -f "$dir/bench.so.xz" ] && unpack "$dir/bench.so.xz" build-gpu/bench/gpu/libbsattn_bench.so
  chmod +x build-gpu/tests/bsattn_*
  source tests/gpu/nccl_env.sh
  if ! build-gpu/tests/bsattn_gpu_test --gtest_list_tests > /dev/null 2> "$OUT/prebuilt.log"; then
    ldd build-gpu/tests/bsattn_gpu_test >> "$OUT/prebuilt.log" 2>&1
    cat "$OUT/prebuilt.log"
    exit 1
  fi
  BUILD=build-gpu STEPS="${STEPS:-tests validation sanitize sass variants}" VARIANT_ONLY=none bash tests/gpu/device_check.sh
  ;;
peers)
  source .peers/b/fa4-peer.sh install .peers || exit 1
  LIB=build-gpu/bench/gpu/libbsattn_bench.so
  if [ -n "${PEER_LIB:-}" ]; then
    LIB=/tmp/peer-lib.so
    unpack "$PEER_LIB" "$LIB"
  fi
  log "forward, issue 14's rows"
  PYTHONUNBUFFERED=1 timeout 430 python3 bench/gpu/bench_forward.py --lib "$LIB" --rows issue14 --peers fa4,cudnn --power \
    --out "$OUT/forward.md" > "$OUT/forward.log" 2>&1
  echo "forward rc=$?"; cat "$OUT/forward.md"
  log "backward"
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/bench_backward.py --lib "$LIB" --peers fa4 --out "$OUT/backward.md" \
    > "$OUT/backward.log" 2>&1
  echo "backward rc=$?"; cat "$OUT/backward.md"
  ;;
ab | bwd-ab)
  # device_check.sh times $BUILD/bench/gpu/libbsattn_bench.so against COMPARE: the base goes there.
  dir=/tmp/ab-libs
  mkdir -p "$dir/bench/gpu"
  n=0
  compare=""
  for f in ${LIBS:?LIBS: the bench libraries to compare, base first}; do
    to=$dir/$n.so
    [ $n = 0 ] && to=$dir/bench/gpu/libbsattn_bench.so
    unpack "$f" "$to"
    [ $n = 0 ] || compare="$compare $to"
    n=$((n + 1))
  done
  cp "$dir/bench/gpu/libbsattn_bench.so" "$dir/aa.so"
  log "A/B: $LIBS, then the base again (A/A)"
  if [ "$STEP" = bwd-ab ]; then
    PYTHONUNBUFFERED=1 timeout "${AB_TIMEOUT:-400}" python3 bench/gpu/bench_backward.py \
      --lib "$dir/bench/gpu/libbsattn_bench.so" --compare $compare "$dir/aa.so" --rows "${ROWS:-causal,rand0.25,rand1.0}" \
      --peers none --rounds "${ROUNDS:-6}" --skip-small-check --out "$OUT/backward-ab.md" > "$OUT/backward-ab.log" 2>&1
    echo "backward A/B rc=$?"
    cat "$OUT/backward-ab.md" 2>/dev/null || tail -20 "$OUT/backward-ab.log"
  else
    BUILD=$dir STEPS=compare COMPARE="$compare $dir/aa.so" COMPARE_ROWS=issue14 COMPARE_ONLY="${ONLY:?ONLY: row prefixes}" \
      COMPARE_ROUNDS="${ROUNDS:-6}" COMPARE_TIMEOUT="${AB_TIMEOUT:-400}" PEERS=none bash tests/gpu/device_check.sh
  fi
  ;;
paged-ab | proxy-ab)
  # Neither benchmark has --compare: one process per library, the libraries alternated. Their
  # results go to a folder of their own, apart from the other steps' files under $OUT.
  bench=${STEP%-ab}
  dir=$OUT/$STEP
  mkdir -p "$dir"
  log "$bench A/B: $LIBS, ${ROUNDS:-2} rounds"
  for r in $(seq "${ROUNDS:-2}"); do
    for f in ${LIBS:?LIBS: the bench libraries to compare}; do
      name=$(basename "$f")
      name=${name%%.*}
      unpack "$f" "/tmp/$name.so"
      PYTHONUNBUFFERED=1 timeout 150 python3 "bench/gpu/bench_$bench.py" --lib "/tmp/$name.so" ${BENCH_ARGS:-} \
        --out "$dir/$bench-$name-$r.md" > "$dir/$bench-$name-$r.log" 2>&1
      echo "== $name, round $r (rc=$?)"
      if [ "$bench" = paged ]; then
        grep -E "paged, pages of (16|64)" "$dir/$bench-$name-$r.md" | awk -F'|' '{print $2, $3, $7}'
      else
        cat "$dir/$bench-$name-$r.md" 2>/dev/null || tail -5 "$dir/$bench-$name-$r.log"
      fi
    done
  done
  ;;
*)
  echo "STEP: full, prebuilt, peers, ab, bwd-ab, paged-ab or proxy-ab (see the header)"
  exit 2
  ;;
esac
log "done"
