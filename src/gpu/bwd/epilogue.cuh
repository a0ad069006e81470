// dK or dV of 64 KV rows from a consumer's accumulator (64 x D, T::MmaDKV), into the gradients'
// dtype and layout; dK takes the softmax scale here (S = scale * Q K^T). Rows past the tile or the
// sequence's owned rows are not stored.
#pragma once
#include "bsattn/backward_params.hpp"
#include "gpu/bwd/elements.cuh"
#include "gpu/bwd/traits.cuh"

namespace bsattn::gpu::bwd {

// row0_offset: the element offset of the accumulator's first KV row; n_store: how many of its
// rows to store.
template <class T, class Acc>
__device__ __forceinline__ void store_dkv(const Acc& acc, int consumer_tid, const BackwardParams& g,
                                          std::int64_t row0_offset, int n_store, bool dk) {
  typename T::MmaDKV mma;
  Tensor c = mma.get_thread_slice(consumer_tid % 128).partition_C(make_identity_tensor(Shape<_64, Int<T::kHeadDim>>{}));
  void* dst = dk ? g.dk : g.dv;
  const std::int64_t token_stride = dk ? g.dk_strides.token : g.dv_strides.token;
  const ElementType type = dk ? g.dk_type : g.dv_type;
  const float factor = dk ? g.fwd.scale : 1.0f;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int row = get<0>(c(e));
    if (row < n_store) store_element(dst, row0_offset + row * token_stride + get<1>(c(e)), type, acc(e) * factor);
  }
}

}  // namespace bsattn::gpu::bwd
