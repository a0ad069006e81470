// dK or dV of 64 KV rows from a consumer's accumulator (64 x D, T::MmaDKV), into the gradients'
// dtype and layout; dK takes the softmax scale here (S = scale * Q K^T). Rows past the tile or the
// sequence's owned rows are not stored.
#pragma once
#include "bsattn/backward_params.hpp"
#include "gpu/bwd/elements.cuh"
#include "gpu/bwd/traits.cuh"
#include "gpu/fwd/utils.cuh"

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

// Solo consumers (T::kSolo) each hold partial dK and dV, over the steps they took. Consumer 0
// keeps dV and hands over its dK, consumer 1 the reverse, through `scratch` (2 x 64 x D floats of
// shared memory, free once both walks are done and their bulk reductions have read their stages),
// in fragment order (16-byte stores and loads, conflict-free); the kept accumulator then holds
// the sum. `t`: the thread's index in its warpgroup.
template <class T, class Acc>
__device__ __forceinline__ void sum_solo_partials(Acc& dv, Acc& dk, float* scratch, int wg, int t) {
  constexpr int kChunks = decltype(size(dv))::value / 4;
  const auto give = [&](const Acc& acc) {
    float4* dst = reinterpret_cast<float4*>(scratch) + wg * 128 * kChunks + t;
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) dst[j * 128] = make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
  };
  const auto take = [&](Acc& acc) {
    const float4* src = reinterpret_cast<const float4*>(scratch) + (1 - wg) * 128 * kChunks + t;
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      const float4 v = src[j * 128];
      acc(4 * j) += v.x;
      acc(4 * j + 1) += v.y;
      acc(4 * j + 2) += v.z;
      acc(4 * j + 3) += v.w;
    }
  };
  fwd::barrier_sync(kStepBarrier, T::kConsumerThreads);  // both walks done: the stages are free
  if (wg == 0) give(dk);
  else give(dv);
  fwd::barrier_sync(kStepBarrier, T::kConsumerThreads);
  if (wg == 0) take(dv);
  else take(dk);
}

}  // namespace bsattn::gpu::bwd
