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
// A kernel variant V for some routes' Q tiles: with g null (plan time) configured (true on an
// error, in e); else launched where it `takes` the route (true, its error in e). False: the caller
// goes on.
template <class V>
bool launch_variant(bool takes, const BackwardParams* g, const BackwardWorkspace& ws, const int* overflow,
                    bool deterministic, cudaStream_t s, cudaError_t& e) {
  if (!g) {
    e = launch_backward<V>(g, ws, overflow, deterministic, s);
    return e != cudaSuccess;
  }
  if (!takes) return false;
  e = launch_backward<V>(g, ws, overflow, deterministic, s);
  return true;
}

// The kernel of KV tile width block_n, and of the problem's step rows (backward_step_rows) or solo
// consumers (backward_solo_steps); with g null (plan time) every kernel of that width is configured.
template <class Element, int kHeadDim, int kFirst, int... kRest>
cudaError_t dispatch_width(const BackwardParams* g, int block_n, const BackwardWorkspace& ws, const int* overflow,
                           bool deterministic, cudaStream_t s) {
  if (block_n == kFirst) {
    const int tile_m = g ? g->fwd.route.tile_m : 0;
    cudaError_t e = cudaSuccess;
    if constexpr (backward_step_rows(kHeadDim, kFirst, 128) == 128)
      if (launch_variant<Traits<Element, kHeadDim, kFirst, 128>>(
              backward_step_rows(kHeadDim, kFirst, tile_m) == 128, g, ws, overflow, deterministic, s, e))
        return e;
    if constexpr (backward_solo_steps(kHeadDim, kFirst, 64))
      if (launch_variant<Traits<Element, kHeadDim, kFirst, 64, true>>(
              backward_solo_steps(kHeadDim, kFirst, tile_m), g, ws, overflow, deterministic, s, e))
        return e;
    return launch_backward<Traits<Element, kHeadDim, kFirst>>(g, ws, overflow, deterministic, s);
  }
  if constexpr (sizeof...(kRest) > 0)
    return dispatch_width<Element, kHeadDim, kRest...>(g, block_n, ws, overflow, deterministic, s);
  return cudaErrorInvalidValue;
}
}  // namespace bsattn::gpu::bwd
