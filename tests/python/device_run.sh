#!/usr/bin/env bash
# On a GPU machine whose python3 has PyTorch, nanobind and scikit-build-core (the device image
# does): builds the package with the GPU engine into WORK_DIR/site and runs tests/python there,
# the GPU tests included (FlexAttention agreement, torch.compile, CUDA graphs).
#
# usage: tests/python/device_run.sh [WORK_DIR] [pytest arguments...]
# CUTLASS headers: CUTLASS_INCLUDE_DIR=<dir with cute/tensor.hpp>, or nvidia-cutlass importable.
# BSATTN_GPU_DTYPES / BSATTN_GPU_HEAD_DIMS bound the kernels compiled (default: what the tests use).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=${1:-/tmp/bsattn-python}
shift $(($# > 0 ? 1 : 0))
mkdir -p "$work"

# The GPU machine's image has scikit-build-core 1.1.0 (2026-12-01) while pyproject pins 1.1.2 as
# the minimum-version: relax it for this offline build.
defines=(-C "minimum-version=1.1" -C "cmake.define.BSATTN_GPU_DTYPES=${BSATTN_GPU_DTYPES:-bf16;f16}"
         -C "cmake.define.BSATTN_GPU_HEAD_DIMS=${BSATTN_GPU_HEAD_DIMS:-64;128}")
[ -n "${CUTLASS_INCLUDE_DIR:-}" ] && defines+=(-C "cmake.define.CUTLASS_INCLUDE_DIR=$CUTLASS_INCLUDE_DIR")
BSATTN_ENABLE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps \
  --no-index --upgrade --target "$work/site" -C build-dir="$work/build" "${defines[@]}" "$root"

cd "$root"
PYTHONPATH="$work/site" python3 -c 'import bsattn, torch; print("bsattn GPU build:", bsattn.built_with_cuda, "| torch", torch.__version__, "| devices", torch.cuda.device_count())'
PYTHONPATH="$work/site" exec python3 -m pytest -p no:cacheprovider -q -rs tests/python "$@"
