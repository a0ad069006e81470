#!/usr/bin/env bash
# Builds the GPU test binary and the benchmark library on a GPU machine that has nvcc, CMake and
# ninja but no registry: the CUTLASS/CuTe headers (the pinned nvidia-cutlass wheel's) and
# GoogleTest arrive as archives made on a machine that has them:
#   tar czf DIR/cutlass.tgz -C "$(python3 -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')/source/include" cute cutlass
#   (gtest.tgz: include/gtest and lib/libgtest{,_main}.a)
# usage: tests/gpu/device_build.sh DIR [BUILD]   (BUILD defaults to build-gpu; BSATTN_CMAKE_ARGS adds
# configure options, e.g. -DBSATTN_GPU_DTYPES=bf16 -DBSATTN_GPU_HEAD_DIMS=128 for a quick benchmark build)
set -euo pipefail
dir=$(cd "$1" && pwd)
build=${2:-build-gpu}
deps=/tmp/bsattn-deps
mkdir -p "$deps/cutlass" "$deps/gtest"
tar xzf "$dir/cutlass.tgz" -C "$deps/cutlass"
tar xzf "$dir/gtest.tgz" -C "$deps/gtest"
source "$(dirname "${BASH_SOURCE[0]}")/nccl_env.sh"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBSATTN_ENABLE_CUDA=ON -DBSATTN_BUILD_TOOLS=OFF \
  -DCUTLASS_INCLUDE_DIR="$deps/cutlass" -DGTEST_ROOT="$deps/gtest" ${BSATTN_CMAKE_ARGS:-} >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target bsattn_gpu_test bsattn_validation_test bsattn_bench > "$build.log" 2>&1 || { grep -E "error|Error" "$build.log" | head -40; exit 1; }
# Kernels with spills (ptxas -v prints "Function properties for NAME" before each figure line).
awk '/Function properties for/{f=$NF} /spill stores/ && !/ 0 bytes spill stores, 0 bytes spill loads/{print f ": " $0}' \
  "$build.log" | sort -u | (c++filt 2>/dev/null || cat) | cut -c1-400 | head -40 || true
# Kernels whose wgmma ptxas serialised (C7510-C7515, an info line: about half the speed).
grep "C751[0-9]" "$build.log" | sed 's/Potential Performance Loss: //' | (c++filt 2>/dev/null || cat) | cut -c1-400 | sort | uniq -c || true
echo "built $build/tests/bsattn_gpu_test and $build/bench/gpu/libbsattn_bench.so"
