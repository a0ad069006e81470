// dK and dV of the CTA's KV tile from the warpgroups' accumulators (warpgroup 0 holds dV,
// warpgroup 1 dK, each kBlockN x D), into the gradients' dtype and layout; dK takes the softmax
// scale here (S = scale * Q K^T). Rows past the tile or the sequence's owned rows are not stored.
#pragma once
#include "bsattn/backward_params.hpp"
#include "gpu/bwd/elements.cuh"
#include "gpu/bwd/traits.cuh"

namespace bsattn::gpu::bwd {

template <class T, class Acc, class ThrMma>
__device__ __forceinline__ void store_dkv(const Acc& acc, const ThrMma& thr, const BackwardParams& g,
                                          const route::SeqInfo& si, int b, int hkv, int k0, int n_store, int wg) {
  Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}));
  void* dst = wg == 0 ? g.dv : g.dk;
  const TokenStrides& strides = wg == 0 ? g.dv_strides : g.dk_strides;
  const ElementType type = wg == 0 ? g.dv_type : g.dk_type;
  const float factor = wg == 0 ? 1.0f : g.fwd.scale;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int row = get<0>(c(e));
    if (row < n_store)
      store_element(dst, g.kv_like_offset(strides, b, si, k0 + row, hkv) + get<1>(c(e)), type, acc(e) * factor);
  }
}

}  // namespace bsattn::gpu::bwd
