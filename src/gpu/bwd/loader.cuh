// Loads of the backward CTA, by all its threads with cp.async (16 bytes each per step, the same
// swizzled shared layouts the wgmma descriptors read): the KV tile's K and V once, then per step
// the 64 rows of Q and dO with their LSE and delta into one of two stages, issued a step ahead.
// Rows past the sequence (or the KV tile) are zero-filled, never read.
#pragma once
#include "bsattn/backward_params.hpp"
#include "gpu/bwd/steps.cuh"
#include "gpu/bwd/traits.cuh"

namespace bsattn::gpu::bwd {

// rows x D elements of one tensor into `tile` (a rows x D view); row(r) is the source address of
// row r, or null for a zero row (then `base`, a valid address, is named but not read).
template <class T, int kRows, class Tile, class RowAddress>
__device__ __forceinline__ void load_rows(Tile tile, const RowAddress& row, const void* base, int tid) {
  constexpr int kChunks = T::kHeadDim / 8;
  constexpr int kRowsPerPass = T::kThreads / kChunks;
  static_assert(T::kThreads % kChunks == 0 && kRows % kRowsPerPass == 0, "whole rows per pass");
  const int d = (tid % kChunks) * 8;
  CUTE_UNROLL
  for (int r0 = 0; r0 < kRows; r0 += kRowsPerPass) {
    const int r = r0 + tid / kChunks;
    const typename T::Element* src = row(r);
    cp_async_16(&tile(r, d), src ? static_cast<const void*>(src + d) : base, src != nullptr);
  }
}

template <class T>
__device__ __forceinline__ void load_kv(typename T::SharedStorage& st, const AttentionParams& a, int b,
                                        const route::SeqInfo& si, int k0, int n_valid, int hkv, int tid) {
  using Element = typename T::Element;
  const auto rows = [&](const void* base, std::int64_t batch, std::int64_t token, std::int64_t head) {
    return [=, &a, &si](int r) -> const Element* {
      return r < n_valid ? static_cast<const Element*>(base) + a.kv_offset(b, si, k0 + r, hkv, batch, token, head)
                         : nullptr;
    };
  };
  load_rows<T, T::kBlockN>(make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{}),
                           rows(a.k, a.k_batch_stride, a.k_token_stride, a.k_head_stride), a.k, tid);
  load_rows<T, T::kBlockN>(make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutK{}),
                           rows(a.v, a.v_batch_stride, a.v_token_stride, a.v_head_stride), a.v, tid);
}

// `valid` rows of kRows x D elements of a Q-like tensor into `tile` (a kRows x D view) from
// `first`, the step's first row, rows token_stride elements apart (the offsets are linear in the
// token); rows at or past `valid` are zero-filled (`first`, a valid address, is named, not read).
// One address per thread and tensor, stepped by a stride per pass.
template <class T, int kRows, class Tile>
__device__ __forceinline__ void load_strided_rows(Tile tile, const typename T::Element* first, std::int64_t token_stride,
                                                  int valid, int tid) {
  constexpr int kChunks = T::kHeadDim / 8;
  constexpr int kRowsPerPass = T::kThreads / kChunks;
  static_assert(T::kThreads % kChunks == 0 && kRows % kRowsPerPass == 0, "whole rows per pass");
  const int d = (tid % kChunks) * 8, r_first = tid / kChunks;
  const typename T::Element* src = first + r_first * token_stride + d;
  CUTE_UNROLL
  for (int r0 = 0; r0 < kRows; r0 += kRowsPerPass) {
    const bool in = r0 + r_first < valid;
    cp_async_16(&tile(r0 + r_first, d), in ? src : first, in);
    src += kRowsPerPass * token_stride;
  }
}

// Q, dO, LSE * log2(e) and delta of one step into `stage`. lse_log2 / delta: [Hq][q_rows], the
// packed row of (b, q) being q_base + q (varlen) or b * Sq + q. The step has at least one row in
// the sequence (the walk stops at the sequence end).
template <class T>
__device__ __forceinline__ void load_step(typename T::SharedStorage& st, const BackwardParams& g, int b,
                                          const route::SeqInfo& si, const Step& s, int stage, const float* lse_log2,
                                          const float* delta, std::int64_t q_rows, int tid) {
  using Element = typename T::Element;
  const AttentionParams& a = g.fwd;
  const int rows = min(64, si.seqlen_q - s.q0);
  Tensor sQ = make_tensor(make_smem_ptr(st.q), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(st.dout), typename T::SmemLayoutQ{});
  load_strided_rows<T, 64>(sQ(_, _, stage), static_cast<const Element*>(a.q) + a.q_offset(b, si, s.q0, s.head),
                           a.q_token_stride, rows, tid);
  load_strided_rows<T, 64>(sdO(_, _, stage),
                           static_cast<const Element*>(g.dout) + g.q_like_offset(g.dout_strides, b, si, s.q0, s.head),
                           g.dout_strides.token, rows, tid);
  if (tid < 128) {
    const int r = tid % 64;
    const std::int64_t packed = (a.route.varlen_q ? si.q_base : static_cast<std::int64_t>(b) * a.route.max_seqlen_q) +
                                s.q0 + r;
    const float* src = (tid < 64 ? lse_log2 : delta) + s.head * q_rows + packed;
    cp_async_4(tid < 64 ? &st.lse_log2[stage][r] : &st.delta[stage][r], r < rows ? src : lse_log2, r < rows);
  }
}

}  // namespace bsattn::gpu::bwd
