#!/usr/bin/env bash
# Builds, on the development machine (nvcc, no GPU), what one device call runs: the GPU test
# binary, the validation test binary and the benchmark library, and packs them xz-compressed
# (about 20 MB each from 210 MB) for `STEP=prebuilt tests/gpu/device_session.sh`, so that the call
# spends no device time compiling (a full device build takes about 5 minutes of it).
#   tests/gpu/pack_prebuilt.sh [BUILD] [DIR]   (BUILD defaults to build-prebuilt, DIR to .device/bin)
# Carry DIR (about 58 MB, under the 64 MiB a call takes; FA4's pieces then go in calls of their own).
# Env: BSATTN_CMAKE_ARGS adds configure options. 2 cores: about 20 minutes the first time.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-prebuilt}
dir=${2:-$root/.device/bin}
source "$root/scripts/setup.sh" >/dev/null
mkdir -p "$build"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBSATTN_ENABLE_CUDA=ON -DBSATTN_BUILD_TOOLS=OFF \
    ${BSATTN_CMAKE_ARGS:-} > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
fi
cmake --build "$build" --target bsattn_gpu_test bsattn_validation_test bsattn_bench > "$build/pack.log" 2>&1 ||
  { grep -E "error|Error" "$build/pack.log" | head -40; exit 1; }
mkdir -p "$dir"
xz -T0 -6 -c "$build/tests/bsattn_gpu_test" > "$dir/gpu_test.xz"
xz -T0 -6 -c "$build/tests/bsattn_validation_test" > "$dir/validation_test.xz"
xz -T0 -6 -c "$build/bench/gpu/libbsattn_bench.so" > "$dir/bench.so.xz"
git -C "$root" describe --always --dirty > "$dir/REV"
echo "packed $(cat "$dir/REV") into $dir:"
ls -l "$dir"
