// Epilogue: normalise the output rows, convert to the output type and store O and LSE. Rows past
// the sequence end are not stored.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bsattn/attention_params.hpp"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

__device__ __forceinline__ void store_pair(void* base, std::int64_t offset, ElementType t, float x, float y) {
  switch (t) {
    case ElementType::f32:
      *reinterpret_cast<float2*>(static_cast<float*>(base) + offset) = make_float2(x, y);
      break;
    case ElementType::f16:
      *reinterpret_cast<__half2*>(static_cast<__half*>(base) + offset) = __floats2half2_rn(x, y);
      break;
    case ElementType::bf16:
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + offset) = __floats2bfloat162_rn(x, y);
      break;
  }
}

// o: output accumulator (rowcol view, already normalised); c: its coordinates in the 64 x D tile.
template <class TO, class TC, int kRows>
__device__ __forceinline__ void store_output(const TO& o, const TC& c, const float (&lse)[kRows],
                                             const AttentionParams& a, const route::SeqInfo& si, int b, int h,
                                             int q_begin) {
  const bool lse_writer = (threadIdx.x % 4) == 0;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int q = q_begin + get<0>(c(i, 0));
    if (q >= si.seqlen_q) continue;
    const std::int64_t row = a.out_offset(b, si, q, h);
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o); j += 2) store_pair(a.out, row + get<1>(c(i, j)), a.out_type, o(i, j), o(i, j + 1));
    if (a.lse && lse_writer) a.lse[a.lse_offset(b, si, q, h)] = lse[i];
  }
}

}  // namespace bsattn::gpu::fwd
