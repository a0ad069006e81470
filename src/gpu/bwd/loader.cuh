// The producer of the backward CTA: its warpgroup walks the CTA's steps (steps.cuh) and loads the
// KV tile's K and V once (cp.async), then per step the 64 rows of Q and dO into the next free
// stage, by TMA (thread 0: D/64 boxes of 64 x 64 per tensor, the 128-byte swizzled layout the
// wgmma descriptors read) where the step's rows all lie in the sequence, else by cp.async (16
// bytes per thread and copy), and its LSE and delta by cp.async; the stage completes on its
// mbarrier. cp.async zero-fills rows past the sequence (or the KV tile): a neighbouring sequence's
// rows would reach dK / dV through a zero P. TMA keeps the step's loads out of the load/store
// queue that the consumers' dQ reductions fill.
#pragma once
#include <cutlass/arch/barrier.h>

#include "bsattn/backward_params.hpp"
#include "gpu/bwd/steps.cuh"
#include "gpu/bwd/traits.cuh"
#include "gpu/fwd/producer.cuh"

namespace bsattn::gpu::bwd {

// `valid` rows of kRows x D elements of a Q-like tensor into `tile` (a kRows x D view) from
// `first`, the step's first row, rows token_stride elements apart (the offsets are linear in the
// token); rows at or past `valid` are zero-filled (`first`, a valid address, is named, not read).
// One address per thread and tensor, stepped by a stride per pass.
template <class T, int kRows, class Tile>
__device__ __forceinline__ void load_strided_rows(Tile tile, const typename T::Element* first, std::int64_t token_stride,
                                                  int valid, int tid) {
  constexpr int kChunks = T::kHeadDim / 8;
  constexpr int kRowsPerPass = T::kProducerThreads / kChunks;
  static_assert(T::kProducerThreads % kChunks == 0 && kRows % kRowsPerPass == 0, "whole rows per pass");
  const int d = (tid % kChunks) * 8, r_first = tid / kChunks;
  const typename T::Element* src = first + r_first * token_stride + d;
  // Unrolled by 4, not fully: the 40-register producer spilled the fully unrolled K/V load (16
  // passes per tensor at D 128).
#pragma unroll 4
  for (int r0 = 0; r0 < kRows; r0 += kRowsPerPass) {
    const bool in = r0 + r_first < valid;
    cp_async_16(&tile(r0 + r_first, d), in ? src : first, in);
    src += kRowsPerPass * token_stride;
  }
}

// K and V of the KV tile (rows past n_valid zero-filled). The backward has no paged KV (plan()
// refuses it), so a tile's rows are token_stride apart.
template <class T>
__device__ __forceinline__ void load_kv(typename T::SharedStorage& st, const AttentionParams& a, int b,
                                        const route::SeqInfo& si, int k0, int n_valid, int hkv, int tid) {
  using Element = typename T::Element;
  load_strided_rows<T, T::kBlockN>(
      make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{}),
      static_cast<const Element*>(a.k) + a.kv_offset(b, si, k0, hkv, a.k_batch_stride, a.k_token_stride, a.k_head_stride),
      a.k_token_stride, n_valid, tid);
  load_strided_rows<T, T::kBlockN>(
      make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutK{}),
      static_cast<const Element*>(a.v) + a.kv_offset(b, si, k0, hkv, a.v_batch_stride, a.v_token_stride, a.v_head_stride),
      a.v_token_stride, n_valid, tid);
}

// Tensor maps of Q and dO (4-D, boxes of 64 x 64: fwd::encode_token_map); tma 0 where TMA cannot
// address them (every step then loads by cp.async).
struct StepMaps {
  CUtensorMap q, dout;
  int tma;
};

// Q, dO, LSE * log2(e) and delta of one step into `stage`. lse_log2 / delta: [Hq][q_rows], the
// packed row of (b, q) being q_base + q (varlen) or b * Sq + q. The step has at least one row in
// the sequence (the walk stops at the sequence end).
// By TMA (tma: the step has 64 rows in the sequence and the maps exist) thread 0 expects the
// boxes' bytes on the stage's barrier, which is its arrival there (the caller wrote the step
// first); else every thread copies its share.
template <class T>
__device__ __forceinline__ void load_step(typename T::SharedStorage& st, const BackwardParams& g, const StepMaps& maps,
                                          bool tma, int b, const route::SeqInfo& si, const Step& s, int stage,
                                          const float* lse_log2, const float* delta, std::int64_t q_rows, int tid) {
  using Element = typename T::Element;
  constexpr int kHeadDim = T::kHeadDim;
  const AttentionParams& a = g.fwd;
  const int rows = min(64, si.seqlen_q - s.q0);
  if (tma) {
    if (tid == 0) {
      fwd::arrive_expect_tx(&st.full[stage], 2 * 64 * kHeadDim * sizeof(Element));
      const int token = (a.route.varlen_q ? static_cast<int>(si.q_base) : 0) + s.q0, batch = a.route.varlen_q ? 0 : b;
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / 64; ++c) {
        const int offset = (stage * kHeadDim + c * 64) * 64;  // the stage's 64 x 64 block c
        fwd::tma_load_4d(st.q + offset, &maps.q, &st.full[stage], c * 64, token, s.head, batch);
        fwd::tma_load_4d(st.dout + offset, &maps.dout, &st.full[stage], c * 64, token, s.head, batch);
      }
    }
  } else {
    Tensor sQ = make_tensor(make_smem_ptr(st.q), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.dout), typename T::SmemLayoutQ{});
    load_strided_rows<T, 64>(sQ(_, _, stage), static_cast<const Element*>(a.q) + a.q_offset(b, si, s.q0, s.head),
                             a.q_token_stride, rows, tid);
    load_strided_rows<T, 64>(sdO(_, _, stage),
                             static_cast<const Element*>(g.dout) + g.q_like_offset(g.dout_strides, b, si, s.q0, s.head),
                             g.dout_strides.token, rows, tid);
  }
  {
    static_assert(T::kProducerThreads == 128, "a thread per LSE and delta value");
    const int r = tid % 64;
    const std::int64_t packed = (a.route.varlen_q ? si.q_base : static_cast<std::int64_t>(b) * a.route.max_seqlen_q) +
                                s.q0 + r;
    const float* src = (tid < 64 ? lse_log2 : delta) + s.head * q_rows + packed;
    cp_async_4(tid < 64 ? &st.lse_log2[stage][r] : &st.delta[stage][r], r < rows ? src : lse_log2, r < rows);
  }
}

// The producer warpgroup (ptid: its thread index). Every thread walks alike and copies its share;
// each arrives on a stage's full barrier once its copies have landed (cp.async arrive, counted in
// the barrier's init), thread 0 also after writing the stage's step (with the TMA bytes expected,
// when the step goes by TMA). After the last step one more stage carries the end of the walk.
template <class T>
__device__ __forceinline__ void produce_steps(typename T::SharedStorage& st, const BackwardParams& g,
                                              const StepMaps& maps, const BackwardWorkspace& ws, const StepWalk& walk,
                                              int b, const route::SeqInfo& si, int k0, int n_valid, int hkv,
                                              int ptid) {
  using Barrier = cutlass::arch::ClusterBarrier;
  load_kv<T>(st, g.fwd, b, si, k0, n_valid, hkv, ptid);
  fwd::cp_async_arrive_noinc(&st.kv_full);
  Step step;
  bool have = n_valid > 0 && walk.first(step);
  for (int i = 0;; ++i) {
    const int stage = i % T::kStages;
    Barrier::wait(&st.empty[stage], ((i / T::kStages) & 1) ^ 1);
    const bool tma = have && maps.tma && step.q0 + 64 <= si.seqlen_q;
    if (ptid == 0) {
      st.step[stage] = step;
      if (!have) st.step[stage].head = -1;
      if (!tma) Barrier::arrive(&st.full[stage]);  // else load_step's expect_tx arrives
    }
    // The thread index through asm, per step: the copies' shared addresses are then recomputed
    // each step rather than hoisted out of the loop (live across it, they spilled).
    if (have)
      load_step<T>(st, g, maps, tma, b, si, step, stage, ws.lse_log2, ws.delta, ws.geometry.q_rows,
                   fwd::opaque_thread_index());
    fwd::cp_async_arrive_noinc(&st.full[stage]);
    if (!have) break;
    have = walk.next(step);
  }
  fwd::cp_async_wait_all();
}

}  // namespace bsattn::gpu::bwd
