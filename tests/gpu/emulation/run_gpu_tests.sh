#!/usr/bin/env bash
# Runs the GPU selection and merge tests (tests/gpu/gpu_select_test.cpp, gpu_merge_test.cpp as they are)
# without a GPU: the kernels' sources compiled for the host on cuda_emulation.hpp, a fake CUDA
# runtime (fake_cudart.cpp: host memory, no streams), src/api/{select,merge}.cpp and
# src/formats/validate_values.cpp compiled with the CUDA path on (device helpers stubbed; validation reads
# "device" metadata through the fake cudaMemcpy), the rest of the library from a CPU build's
# libbsattn.a.
#   tests/gpu/emulation/run_gpu_tests.sh <libbsattn.a of a CPU build> [gtest arguments]
# Graph capture is not emulated: the GpuSelectGraph test is filtered out. BSATTN_EMULATION_REVERSE=1
# runs each block's threads in reverse order between barriers (a missing barrier changes results).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
lib=${1:?usage: run_gpu_tests.sh path/to/libbsattn.a [gtest arguments]}
shift
out=${OUT_DIR:-/tmp/bsattn_gpu_emulation}
mkdir -p "$out"
cuda_include=${CUDA_INCLUDE:-/usr/local/cuda/include}
flags=(-std=c++20 -O2 -ffp-contract=off -w -DBSATTN_WITH_CUDA=1 -DBSATTN_GPU_HOST_EMULATION=1
       -I"$here/stub" -I"$root/include" -I"$root/src" -I"$root/tests/cpu" -I"$root/tests/gpu" -I"$cuda_include")
objects=()
for src in "$here/select_kernel_emulated.cpp" "$here/merge_kernel_emulated.cpp" "$here/fake_cudart.cpp" \
           "$root/src/api/select.cpp" "$root/src/api/merge.cpp" "$root/src/formats/validate_values.cpp" \
           "$root/tests/cpu/oracle.cpp" \
           "$root/tests/gpu/gpu_select_test.cpp" "$root/tests/gpu/gpu_merge_test.cpp"; do
  object="$out/$(basename "${src%.*}").o"
  g++ "${flags[@]}" -c "$src" -o "$object"
  objects+=("$object")
done
g++ -o "$out/gpu_tests_emulated" "${objects[@]}" "$lib" -lgtest -lgtest_main -lpthread
"$out/gpu_tests_emulated" --gtest_filter='-GpuSelectGraph.*' "$@"
