// Global -> shared loads of Q and of a route's K/V tile (cp.async, 16 bytes a thread a step).
// Rows are addressed token by token through AttentionParams (batched, varlen and paged KV share
// this path); rows past the tile or the sequence are zero-filled, so masked columns multiply
// zeros in the PV GEMM, never stale shared memory.
#pragma once
#include "bsattn/attention_params.hpp"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

template <class T>
struct Loader {
  using Element = typename T::Element;
  static constexpr int kChunksPerRow = T::kHeadDim / 8;
  static constexpr int kRowsPerStep = T::kThreads / kChunksPerRow;
  static_assert(T::kThreads % kChunksPerRow == 0, "loader shape");

  // Q rows [q0, q0 + kBlockM) into the per-warpgroup Q tiles.
  __device__ __forceinline__ static void load_q(typename T::SharedStorage& st, const AttentionParams& a,
                                                const route::SeqInfo& si, int b, int h, int q0, int tid) {
    const Element* q = static_cast<const Element*>(a.q);
    const int d = (tid % kChunksPerRow) * 8;
    CUTE_UNROLL
    for (int r0 = 0; r0 < T::kBlockM; r0 += kRowsPerStep) {
      const int r = r0 + tid / kChunksPerRow;
      const int tok = q0 + r;
      const bool valid = tok < si.seqlen_q;
      const Element* src = valid ? q + a.q_offset(b, si, tok, h) + d : q;
      Tensor sQ = make_tensor(make_smem_ptr(st.q[r / 64]), typename T::SmemLayoutQ{});
      cp_async_16(&sQ(r % 64, d), src, valid);
    }
  }

  // KV tokens [k0, k0 + n_valid) of K (kIsV false, stored (n, d)) or of V (stored transposed,
  // (d, n)) into stage `stage`.
  template <bool kIsV>
  __device__ __forceinline__ static void load_kv(typename T::SharedStorage& st, const AttentionParams& a,
                                                 const route::SeqInfo& si, int b, int hkv, int k0, int n_valid,
                                                 int stage, int tid) {
    const Element* base = static_cast<const Element*>(kIsV ? a.v : a.k);
    const std::int64_t bs = kIsV ? a.v_batch_stride : a.k_batch_stride;
    const std::int64_t ts = kIsV ? a.v_token_stride : a.k_token_stride;
    const std::int64_t hs = kIsV ? a.v_head_stride : a.k_head_stride;
    Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutVt{});
    const int d = (tid % kChunksPerRow) * 8;
    CUTE_UNROLL
    for (int n0 = 0; n0 < T::kBlockN; n0 += kRowsPerStep) {
      const int n = n0 + tid / kChunksPerRow;
      if (T::kBlockN % kRowsPerStep != 0 && n >= T::kBlockN) break;
      const bool valid = n < n_valid;
      const Element* src = valid ? base + a.kv_offset(b, si, k0 + n, hkv, bs, ts, hs) + d : base;
      if constexpr (kIsV) cp_async_16(&sVt(d, n, stage), src, valid);
      else cp_async_16(&sK(n, d, stage), src, valid);
    }
  }
};

}  // namespace bsattn::gpu::fwd
