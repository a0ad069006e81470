// One (dtype, head dim) family of backward kernels by KV tile width; each family is one
// translation unit (../bwd_<dtype>_d<D>.cu).
#pragma once
#include "gpu/bwd/kernel.cuh"

// Defines bsattn::gpu::bwd::run_<NAME>(params or null, block_n, workspace, overflow,
// deterministic, stream).
#define BSATTN_BACKWARD_FAMILY(NAME, ELEMENT, HEAD_DIM, ...)                                                   \
  namespace bsattn::gpu::bwd {                                                                                 \
  cudaError_t run_##NAME(const BackwardParams* g, int block_n, const BackwardWorkspace& ws, const int* overflow, \
                         bool deterministic, cudaStream_t s) {                                                 \
    return dispatch_width<ELEMENT, HEAD_DIM, __VA_ARGS__>(g, block_n, ws, overflow, deterministic, s);         \
  }                                                                                                            \
  }

namespace bsattn::gpu::bwd {
// The kernel of KV tile width block_n, and of the problem's step rows (backward_step_rows); with g
// null (plan time) every kernel of that width is configured.
template <class Element, int kHeadDim, int kFirst, int... kRest>
cudaError_t dispatch_width(const BackwardParams* g, int block_n, const BackwardWorkspace& ws, const int* overflow,
                           bool deterministic, cudaStream_t s) {
  if (block_n == kFirst) {
    if constexpr (backward_step_rows(kHeadDim, kFirst, 128) == 128) {
      using Rows128 = Traits<Element, kHeadDim, kFirst, 128>;
      if (!g) {
        const cudaError_t e = launch_backward<Rows128>(g, ws, overflow, deterministic, s);
        if (e != cudaSuccess) return e;
      } else if (backward_step_rows(kHeadDim, kFirst, g->fwd.route.tile_m) == 128) {
        return launch_backward<Rows128>(g, ws, overflow, deterministic, s);
      }
    }
    return launch_backward<Traits<Element, kHeadDim, kFirst>>(g, ws, overflow, deterministic, s);
  }
  if constexpr (sizeof...(kRest) > 0)
    return dispatch_width<Element, kHeadDim, kRest...>(g, block_n, ws, overflow, deterministic, s);
  return cudaErrorInvalidValue;
}
}  // namespace bsattn::gpu::bwd
