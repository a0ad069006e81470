// The producer of the backward CTA: its warpgroup walks the CTA's steps (steps.cuh) and loads the
// KV tile's K and V once (cp.async), then per step the kStepRows rows of Q and dO into the next
// free stage, by TMA (thread 0: boxes of 64 x 64, the 128-byte swizzled layout the wgmma
// descriptors read) where the step's rows all lie in the sequence, else by cp.async (16
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

// Q and dO of one step into `stage` by TMA (the step has kStepRows rows in the sequence and the
// maps exist), by thread 0: it expects the boxes' bytes on the stage's barrier, which is its
// arrival there (the caller wrote the step first), and issues (kStepRows / 64) x (D / 64) boxes of
// 64 x 64 per tensor (SmemLayoutQ: rows first, then 64-column blocks, then stages).
template <class T>
__device__ __forceinline__ void issue_step_tma(typename T::SharedStorage& st, const AttentionParams& a,
                                               const StepMaps& maps, int b, const route::SeqInfo& si, const Step& s,
                                               int stage) {
  constexpr int kHeadDim = T::kHeadDim;
  const int token = (a.route.varlen_q ? static_cast<int>(si.q_base) : 0) + s.q0;
  constexpr int kStepRows = T::kStepRows;
  fwd::arrive_expect_tx(&st.full[stage], 2 * kStepRows * kHeadDim * sizeof(typename T::Element));
  const int batch = a.route.varlen_q ? 0 : b;
  CUTE_UNROLL
  for (int c = 0; c < kHeadDim / 64; ++c) {
    CUTE_UNROLL
    for (int h = 0; h < kStepRows / 64; ++h) {
      const int offset = (stage * kHeadDim + c * 64) * kStepRows + h * 64 * 64;  // rows 64 h.., columns 64 c..
      fwd::tma_load_4d(st.q + offset, &maps.q, &st.full[stage], c * 64, token + 64 * h, s.head, batch);
      fwd::tma_load_4d(st.dout + offset, &maps.dout, &st.full[stage], c * 64, token + 64 * h, s.head, batch);
    }
  }
}

// Every producer thread's share of one step in `stage` (tid: its index, opaque): Q and dO unless
// they go by TMA (`tma`), by cp.async with the rows past the sequence zero-filled, and LSE *
// log2(e) and delta. lse_log2 / delta: [Hq][q_rows], the packed row of (b, q) being q_base + q
// (varlen) or b * Sq + q. The step has at least one row in the sequence (the walk stops at the
// sequence end).
template <class T>
__device__ __forceinline__ void load_step(typename T::SharedStorage& st, const BackwardParams& g, bool tma, int b,
                                          const route::SeqInfo& si, const Step& s, int stage, const float* lse_log2,
                                          const float* delta, std::int64_t q_rows, int tid) {
  using Element = typename T::Element;
  const AttentionParams& a = g.fwd;
  __builtin_assume(tid >= 0 && tid < T::kProducerThreads);  // shifts, not signed division sequences
  constexpr int kStepRows = T::kStepRows;
  const int rows = min(kStepRows, si.seqlen_q - s.q0);
  if (!tma) {
    Tensor sQ = make_tensor(make_smem_ptr(st.q), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.dout), typename T::SmemLayoutQ{});
    load_strided_rows<T, kStepRows>(sQ(_, _, stage), static_cast<const Element*>(a.q) + a.q_offset(b, si, s.q0, s.head),
                                    a.q_token_stride, rows, tid);
    load_strided_rows<T, kStepRows>(
        sdO(_, _, stage), static_cast<const Element*>(g.dout) + g.q_like_offset(g.dout_strides, b, si, s.q0, s.head),
        g.dout_strides.token, rows, tid);
  }
  static_assert(T::kProducerThreads == 128, "a thread per 64 rows' LSE or delta value");
  const int r = tid % 64;
  // The value's index in 32 bits: Hq x q_rows floats sit in the workspace beside the fp32 dQ
  // accumulator's D times as many, far below 2^32 (64-bit, it was a wide multiply-add chain).
  const unsigned packed0 =
      static_cast<unsigned>(a.route.varlen_q ? si.q_base : static_cast<std::int64_t>(b) * a.route.max_seqlen_q);
  const unsigned row = static_cast<unsigned>(s.head) * static_cast<unsigned>(q_rows) + packed0 + s.q0 + r;
  const float* src = (tid < 64 ? lse_log2 : delta) + row;
  float* dst = tid < 64 ? st.lse_log2[stage] : st.delta[stage];
  CUTE_UNROLL
  for (int h = 0; h < kStepRows; h += 64) cp_async_4(dst + r + h, r + h < rows ? src + h : lse_log2, r + h < rows);
}

// The producer warpgroup (ptid: its thread index). Its first warp walks the steps: thread 0
// writes each step's record into the stage and arrives on the stage's record barrier. The other
// three warps do not walk (the walk's dependent loads, divisions and branches were most of their
// instructions per step): they read the step from the stage's record. Every thread copies its
// share and arrives on the stage's full barrier once its copies have landed (cp.async arrive,
// counted in the barrier's init); thread 0 also after writing the record (with the TMA bytes
// expected, when the step goes by TMA). After the last step T::kEndRecords more stages carry the
// end of the walk (head -1), one for each consumer that reads its own stages (solo). The walker
// rewrites a stage's record only after its empty barrier, which follows every thread's arrival on
// the full barrier, so no record is overwritten unread.
template <class T>
__device__ __forceinline__ void produce_steps(typename T::SharedStorage& st, const BackwardParams& g,
                                              const StepMaps& maps, const BackwardWorkspace& ws, const StepWalk& walk,
                                              int b, const route::SeqInfo& si, int k0, int n_valid, int hkv,
                                              int ptid) {
  using Barrier = cutlass::arch::ClusterBarrier;
  load_kv<T>(st, g.fwd, b, si, k0, n_valid, hkv, ptid);
  fwd::cp_async_arrive_noinc(&st.kv_full);
  // The thread index through asm, per step: the copies' shared addresses are then recomputed
  // each step rather than hoisted out of the loop (live across it, they spilled).
  const auto load = [&](const Step& step, int stage, bool tma) {
    load_step<T>(st, g, tma, b, si, step, stage, ws.lse_log2, ws.delta, ws.geometry.q_rows, fwd::opaque_thread_index());
  };
  const auto by_tma = [&](const Step& step) { return maps.tma && step.q0 + T::kStepRows <= si.seqlen_q; };
  if (__shfl_sync(0xffffffffu, ptid / 32, 0) != 0) {
    for (int i = 0, ends = 0;; ++i) {
      const int stage = i % T::kStages;
      Barrier::wait(&st.record[stage], (i / T::kStages) & 1);
      const Step step = st.step[stage];
      if (step.head >= 0) load(step, stage, by_tma(step));
      fwd::cp_async_arrive_noinc(&st.full[stage]);
      if (step.head < 0 && ++ends == T::kEndRecords) break;
    }
  } else {
    Step step;
    bool have = n_valid > 0 && walk.first(step);
    for (int i = 0, ends = 0;; ++i) {
      const int stage = i % T::kStages;
      Barrier::wait(&st.empty[stage], ((i / T::kStages) & 1) ^ 1);
      const bool tma = have && by_tma(step);
      if (ptid == 0) {
        st.step[stage] = step;
        if (!have) st.step[stage].head = -1;
        Barrier::arrive(&st.record[stage]);
        if (tma) issue_step_tma<T>(st, g.fwd, maps, b, si, step, stage);  // its expect_tx arrives
        else Barrier::arrive(&st.full[stage]);
      }
      if (have) load(step, stage, tma);
      fwd::cp_async_arrive_noinc(&st.full[stage]);
      if (!have) {
        if (++ends == T::kEndRecords) break;
        continue;
      }
      have = walk.next(step);
    }
  }
  fwd::cp_async_wait_all();
}

}  // namespace bsattn::gpu::bwd
