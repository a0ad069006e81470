// The decode policy of the forward kernel (Traits::kDecode). A decode step has one to a few
// queries per sequence and reads a long K/V: the prefill tiles (64 query tokens of one head) would
// leave most rows empty and read every K/V tile once per query head. The decode kernel instead
// fills its one warpgroup's 64 rows with the P query heads of one KV group (P a power of two
// dividing the group, so they share the K/V tiles and the sparsity head) times T = 64 / P tokens:
// row r is token r % T of head r / T (the order a TMA box {D 64, T tokens, P heads} lands in
// shared memory), so each K/V tile is read once per P heads. When (route rows x head groups) do
// not fill the multiprocessors, each is split into `kv_splits` work items over its routes
// (split-KV); their fp32 partial O and LSE go to a workspace, and the last split of a (route row,
// head group) to finish combines them (merge_splits). Everything else — producer, pipeline, mask,
// softmax, epilogue — is the prefill kernel's.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "api/merge_params.hpp"
#include "gpu/attention.hpp"
#include "gpu/fwd/timeline.cuh"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

// What a decode kernel takes at launch (the prefill kernels: the defaults).
struct DecodeGeometry {
  int packed_heads = 1;
  int tokens_log2 = 6;  // log2(T)
  int kv_splits = 1;
  std::int64_t out_split_step = 0, lse_split_step = 0;
  merge::Layout result;  // with splits: where merge_splits writes O and LSE (the caller's outputs)
  ElementType result_type = ElementType::bf16;
  std::int32_t* split_arrivals = nullptr;  // with splits: per (route row, head group), zero between launches
  int routes_from_lengths = 0;  // DecodeShape::routes_from_lengths
};

inline DecodeGeometry decode_geometry(const DecodeShape& s) {
  DecodeGeometry g;
  g.packed_heads = s.packed_heads;
  g.tokens_log2 = 0;
  while ((64 >> g.tokens_log2) > s.packed_heads) ++g.tokens_log2;
  g.kv_splits = s.kv_splits;
  g.out_split_step = s.out_split_step;
  g.lse_split_step = s.lse_split_step;
  g.result = s.result;
  g.result_type = s.result_type;
  g.split_arrivals = s.split_arrivals;
  g.routes_from_lengths = s.routes_from_lengths ? 1 : 0;
  return g;
}

// The query token (relative to the warpgroup's first) and head (relative to its first) of row r of
// a warpgroup tile: compile-time identity for the prefill kernels.
template <bool kPacked>
struct TileRows {
  int tokens_log2;
  __host__ __device__ __forceinline__ int tokens() const { return kPacked ? 1 << tokens_log2 : 64; }
  __host__ __device__ __forceinline__ int token(int r) const { return kPacked ? r & ((1 << tokens_log2) - 1) : r; }
  __host__ __device__ __forceinline__ int head(int r) const { return kPacked ? r >> tokens_log2 : 0; }
};

// Where the epilogue writes, moved by a work item's split (0 without splits).
struct OutputShift {
  std::int64_t out = 0, lse = 0;
};

// Split-KV combined in the kernel: once a warpgroup has stored its split's partial O and LSE, it
// counts its arrival for the (route row, head group) `job.unit`; the last of the kv_splits to
// arrive merges every split's rows into the result (merge::Accumulator, the rules of
// merge_states, in batches of splits) and sets the count back to zero for the next launch. This
// replaced a merge_states launch after the kernel: 7 us of a 42 us B = 1 decode step on the H200,
// mostly its launch and four tiny blocks' dependent loads. The partials are read through L2 (ld.global.cg):
// another multiprocessor wrote them, and this one's L1 may hold lines of an earlier launch.
// Rows past the sequence end are neither partial nor merged.
// It runs after the CTA's tile loop, from the job the epilogue left in shared memory: inside the
// loop the next tile's first S GEMM is in flight during the epilogue and the merge's registers on
// top of it spilled (146-224 bytes). A split-KV launch has one CTA per work item, so a CTA has at
// most one job.
struct SplitMerge {
  int pending;  // the epilogue stored a split's partial result
  int last;     // its arrival was the last one: this warpgroup merges
  int unit, b, head, q_begin;
  route::SeqInfo si;
};

// Arrival of a CTA's warpgroup at a counter other CTAs read: the release orders the warpgroup's
// stores before it (the barrier before it made them this thread's), the acquire the other
// arrivals' stores before what follows (the barrier after it passes that on). One thread and no
// full fences: __threadfence() in every thread (fence.sc, an L1 invalidation) before and after
// the atomic cost 1 us of a 20 us step.
__device__ __forceinline__ int arrive_acq_rel(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

template <class Out>
__device__ __forceinline__ void store_quad(Out* dst, float4 v) {
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    Out x[4] = {Out(v.x), Out(v.y), Out(v.z), Out(v.w)};
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(x);
  }
}

template <int kHeadDim>
__device__ __forceinline__ void merge_splits(const AttentionParams& a, const DecodeGeometry& g, SplitMerge& job,
                                             int tokens, int wg_tid, int barrier_id,
                                             std::uint64_t* timeline = nullptr) {
  barrier_sync(barrier_id, 128);  // the warpgroup's partial stores, before thread 0's release
  if (!job.pending) return;
  if (wg_tid == 0) {
    const bool is_last = arrive_acq_rel(&g.split_arrivals[job.unit]) == g.kv_splits - 1;
    if (is_last) g.split_arrivals[job.unit] = 0;  // the next launch (ordered by the launch boundary)
    job.last = is_last;
  }
  barrier_sync(barrier_id, 128);
  timeline_mark(timeline, kSplitArrived);
  if (!job.last) return;
  const route::SeqInfo si = job.si;
  const int b = job.b, h = job.head, q_begin = job.q_begin;
  // Rows of the tile inside the sequence: `rows_per_head` tokens of each of the packed heads.
  const int rows_per_head = min(tokens, si.seqlen_q - q_begin), rows = rows_per_head * (64 / tokens);
  // A warp merges a row: lane j holds the LSE of split j of a batch of kBatch (the batch's
  // maximum and weight sum by warp reductions) and 4 columns of the row per 128 (O's parts in a
  // batch loaded together). Straight-line code and one exponential per lane, as the 8 merging
  // CTAs run it cold: one (row, 4 columns) per thread with an online merge one split at a time
  // was 1 350 instructions and 3 us after the last arrival (decode_timeline.py).
  constexpr int kBatch = 16, kChunks = kHeadDim / 4, kLaneChunks = (kChunks + 31) / 32;
  const int lane = wg_tid % 32;
  const float* parts = static_cast<const float*>(a.out);
  const bool varlen = a.route.varlen_q;
  using merge::Accumulator;
  for (int row = wg_tid / 32; row < rows; row += 4) {
    const int q = q_begin + row % rows_per_head, head = h + row / rows_per_head;
    const float* lse_at = a.lse + a.lse_offset(b, si, q, head);
    const float* o_at = parts + a.out_offset(b, si, q, head) + lane * 4;
    Accumulator acc;
    float4 o[kLaneChunks];
    CUTE_UNROLL
    for (int c = 0; c < kLaneChunks; ++c) o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < g.kv_splits; s0 += kBatch) {
      const int n = min(kBatch, g.kv_splits - s0);
      float4 x[kBatch][kLaneChunks];
      const float* part = o_at + s0 * g.out_split_step;
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j, part += g.out_split_step) {
        CUTE_UNROLL
        for (int c = 0; c < kLaneChunks; ++c) {
          const bool in = j < n && lane + 32 * c < kChunks;
          x[j][c] = in ? __ldcg(reinterpret_cast<const float4*>(part + 128 * c)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      const float lse = lane < n ? __ldcg(lse_at + (s0 + lane) * g.lse_split_step) : -INFINITY;
      float m = lse;
      CUTE_UNROLL
      for (int d = 16; d > 0; d /= 2) m = Accumulator::max_of(m, __shfl_xor_sync(0xffffffffu, m, d));
      const float rescale = acc.rebase(Accumulator::max_of(acc.max_lse, m));
      const float w = acc.weight(lse);
      float total = w;
      CUTE_UNROLL
      for (int d = 16; d > 0; d /= 2) total += __shfl_xor_sync(0xffffffffu, total, d);
      acc.sum += __shfl_sync(0xffffffffu, total, 0);  // lane 0's: every lane normalises alike
      CUTE_UNROLL
      for (int c = 0; c < kLaneChunks; ++c)
        o[c] = make_float4(o[c].x * rescale, o[c].y * rescale, o[c].z * rescale, o[c].w * rescale);
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w, j);
        if (wj == 0.0f) continue;  // an empty split's O is never used (merge_states' rule)
        CUTE_UNROLL
        for (int c = 0; c < kLaneChunks; ++c)
          o[c] = make_float4(fmaf(wj, x[j][c].x, o[c].x), fmaf(wj, x[j][c].y, o[c].y), fmaf(wj, x[j][c].z, o[c].z),
                             fmaf(wj, x[j][c].w, o[c].w));
      }
    }
    const float inv = acc.inv_sum();
    const std::int64_t rb = varlen ? 0 : b, rq = varlen ? si.q_base + q : q;
    const std::int64_t at = g.result.out_offset(rb, rq, head) + lane * 4;
    CUTE_UNROLL
    for (int c = 0; c < kLaneChunks; ++c) {
      if (lane + 32 * c >= kChunks) break;
      const float4 v = make_float4(o[c].x * inv, o[c].y * inv, o[c].z * inv, o[c].w * inv);
      switch (g.result_type) {
        case ElementType::f32: store_quad(static_cast<float*>(g.result.out) + at + 128 * c, v); break;
        case ElementType::f16: store_quad(static_cast<__half*>(g.result.out) + at + 128 * c, v); break;
        case ElementType::bf16: store_quad(static_cast<__nv_bfloat16*>(g.result.out) + at + 128 * c, v); break;
      }
    }
    if (lane == 0 && g.result.lse) g.result.lse[g.result.lse_offset(rb, rq, head)] = acc.lse();
  }
  timeline_mark(timeline, kSplitMerged);
}

}  // namespace bsattn::gpu::fwd
