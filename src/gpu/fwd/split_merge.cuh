// Split-KV partial results of the decode kernel (decode.cuh) merged inside the kernel: through
// the plan's workspace by the last split to finish, or pushed into the shared memory of the
// cluster CTA that merges them. Both merge a row by MergedRow, the rules of merge_states.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "api/merge_params.hpp"
#include "gpu/fwd/decode.cuh"
#include "gpu/fwd/timeline.cuh"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

// Split-KV combined in the kernel, in one of two ways (DecodeGeometry::cluster_merge). Through the
// workspace (merge_splits): once a warpgroup has stored its split's partial O and LSE, it counts
// its arrival for the (route row, head group) `job.unit`; the last of the kv_splits to arrive
// merges every split's rows into the result and sets the count back to zero for the next launch.
// In a cluster (push_partial, merge_cluster_splits): each split pushes its rows into the shared
// memory of the CTA that merges them. Both merge by merge::Accumulator, the rules of merge_states,
// in batches of splits. This replaced a merge_states launch after the kernel: 7 us of a 42 us
// B = 1 decode step on the H200, mostly its launch and four tiny blocks' dependent loads.
// Rows past the sequence end are neither partial nor merged.
// It runs after the CTA's tile loop, from the job the epilogue left in shared memory: inside the
// loop the next tile's first S GEMM is in flight during the epilogue and the merge's registers on
// top of it spilled (146-224 bytes). A split-KV launch has one CTA per work item, so a CTA has at
// most one job.
struct SplitMerge {
  int pending;  // the epilogue stored (or pushed) a split's partial result
  int last;     // workspace merge: its arrival was the last one, this warpgroup merges
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

// One merged row: lane j holds the LSE of split j of a batch of kBatch (the batch's maximum and
// weight sum by warp reductions) and 4 columns of the row per 128 (O's parts in a batch loaded
// together). Straight-line code and one exponential per lane, as the merging CTAs run it cold:
// one (row, 4 columns) per thread with an online merge one split at a time was 1 350
// instructions and 3 us after the last arrival (decode_timeline.py). `Parts` reads split s's
// partial row: lse(s), and o4(s, c), the lane's 4 columns of chunk c (columns lane * 4 + 128 c).
template <int kHeadDim>
struct MergedRow {
  static constexpr int kChunks = kHeadDim / 4, kLaneChunks = (kChunks + 31) / 32;
  merge::Accumulator acc;
  float4 o[kLaneChunks];

  template <class Parts>
  __device__ __forceinline__ MergedRow(const Parts& parts, int splits, int lane) {
    constexpr int kBatch = 16;
    using merge::Accumulator;
    CUTE_UNROLL
    for (int c = 0; c < kLaneChunks; ++c) o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
      const int n = min(kBatch, splits - s0);
      float4 x[kBatch][kLaneChunks];
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        CUTE_UNROLL
        for (int c = 0; c < kLaneChunks; ++c)
          x[j][c] = j < n && lane + 32 * c < kChunks ? parts.o4(s0 + j, c) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      const float lse = lane < n ? parts.lse(s0 + lane) : -INFINITY;
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
  }

  // Into the result (token rq of batch rb, `head`; rb = 0 and rq the packed token when varlen).
  __device__ __forceinline__ void store(const DecodeGeometry& g, std::int64_t rb, std::int64_t rq, int head,
                                        int lane) const {
    const float inv = acc.inv_sum();
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
};

// The splits' partial rows in the plan's fp32 workspace (laid out as the outputs, split after
// split), read through L2: another multiprocessor wrote them, and this one's L1 may hold lines of
// an earlier launch.
struct WorkspaceParts {
  const float* o_at;    // split 0's row, at the lane's first column
  const float* lse_at;  // split 0's LSE of the row
  std::int64_t out_step, lse_step;
  __device__ __forceinline__ float4 o4(int s, int c) const {
    return __ldcg(reinterpret_cast<const float4*>(o_at + s * out_step + 128 * c));
  }
  __device__ __forceinline__ float lse(int s) const { return __ldcg(lse_at + s * lse_step); }
};

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
  const int lane = wg_tid % 32;
  const bool varlen = a.route.varlen_q;
  for (int row = wg_tid / 32; row < rows; row += 4) {  // a warp per row
    const int q = q_begin + row % rows_per_head, head = h + row / rows_per_head;
    const WorkspaceParts parts{static_cast<const float*>(a.out) + a.out_offset(b, si, q, head) + lane * 4,
                               a.lse + a.lse_offset(b, si, q, head), g.out_split_step, g.lse_split_step};
    const MergedRow<kHeadDim> merged(parts, g.kv_splits, lane);
    merged.store(g, varlen ? 0 : b, varlen ? si.q_base + q : q, head, lane);
  }
  timeline_mark(timeline, kSplitMerged);
}

// ---------------------------------------------------------------- merge in a cluster
// With `cluster_merge` the kv_splits CTAs of a (route row, head group) are one cluster (CTA rank
// = split). Row k of the tile's rows inside the sequence (in merge order: packed head, then token)
// is merged by the CTA of rank k % splits, its owner, from an inbox in the owner's shared memory:
// each split pushes its normalised fp32 row and LSE there with st.async, which completes on the
// owner's mbarrier (armed by the owner with the bytes it expects), and goes on; the owner waits for
// its barrier and merges from its own shared memory. So no cluster barrier follows the loop and no
// load leaves the multiprocessor. The pull merge this replaced (each split kept its rows, a cluster
// barrier, the merging warps read the peers' rows, a second barrier so that no CTA left while read)
// spent ~3.5 us of a 21 us step after the last split's loop (bench/RESULTS.md, 2026-12-04 16:1x).
// The one cluster barrier left is split: every thread arrives right after the barrier setup, and
// a consumer waits before its first push, long after, so that every owner's barrier is initialised.
// 16-byte aligned: the merge reads the rows as float4 (InboxParts::o4). Placed after the kernel's
// other shared storage, which may end at any 8-byte boundary, it was aligned only by chance (a
// byte added before it moved it by 8: misaligned-address faults in every decode step, 2026-12-06).
template <int kHeadDim, int kParts>
struct alignas(16) MergeInbox {
  float o[kParts][kHeadDim];  // part j * splits + s: split s's row of the owner's j-th row
  float lse[kParts];
  alignas(8) std::uint64_t full;  // completes when every split's parts of the owner's rows landed
};

// The tile's rows inside the sequence, in merge order.
struct MergeRows {
  int per_head, count;
  __device__ __forceinline__ MergeRows(const route::SeqInfo& si, int q_begin, int tokens, int packed_heads)
      : per_head(min(tokens, si.seqlen_q - q_begin)), count(per_head * packed_heads) {}
  // The rows rank `split` of `splits` owns.
  __device__ __forceinline__ int owned(int split, int splits) const {
    return count > split ? (count - split + splits - 1) / splits : 0;
  }
};

// One warpgroup's normalised partial O (rowcol view `o`, coordinates `c`) and LSE of the rows
// inside the sequence, into their owners' inboxes; before that, thread 0 arms this CTA's inbox
// with the bytes of the rows it owns.
template <int kHeadDim, int kParts, class TO, class TC, int kRows>
__device__ __forceinline__ void push_partial(const TO& o, const TC& c, const float (&lse)[kRows],
                                             MergeInbox<kHeadDim, kParts>& inbox, const DecodeGeometry& g,
                                             const route::SeqInfo& si, int q_begin, TileRows<true> tile_rows,
                                             int wg_tid) {
  const int splits = g.kv_splits, split = static_cast<int>(cute::block_rank_in_cluster());
  const MergeRows rows(si, q_begin, tile_rows.tokens(), g.packed_heads);
  if (wg_tid == 0) arrive_expect_tx(&inbox.full, rows.owned(split, splits) * splits * (kHeadDim + 1) * sizeof(float));
  cluster_wait();  // every owner's inbox is initialised (the kernel's setup arrived)
  CUTE_UNROLL
  for (int i = 0; i < size<0>(o); ++i) {
    const int r = get<0>(c(i, 0)), token = tile_rows.token(r);
    if (token >= rows.per_head) continue;
    const int k = tile_rows.head(r) * rows.per_head + token, owner = k % splits, part = (k / splits) * splits + split;
    const unsigned dst = peer_address(&inbox.o[part][0], owner), bar = peer_address(&inbox.full, owner);
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o); j += 2)
      st_async(dst + get<1>(c(i, j)) * sizeof(float), make_float2(o(i, j), o(i, j + 1)), bar);
    if ((threadIdx.x % 4) == 0) st_async(peer_address(&inbox.lse[part], owner), lse[i], bar);
  }
}

// The parts of one owned row in this CTA's inbox.
struct InboxParts {
  const float* o_at;    // split 0's part, at the lane's first column
  const float* lse_at;  // split 0's LSE
  int o_step;
  __device__ __forceinline__ float4 o4(int s, int c) const {
    return *reinterpret_cast<const float4*>(o_at + s * o_step + 128 * c);
  }
  __device__ __forceinline__ float lse(int s) const { return lse_at[s]; }
};

// The rows this CTA owns, merged into the result once every split's parts have landed: a warp per row.
template <int kHeadDim, int kParts>
__device__ __forceinline__ void merge_cluster_splits(const AttentionParams& a, const DecodeGeometry& g,
                                                     const SplitMerge& job, MergeInbox<kHeadDim, kParts>& inbox,
                                                     int tokens, int wg_tid, int barrier_id,
                                                     std::uint64_t* timeline = nullptr) {
  barrier_sync(barrier_id, 128);  // the job, written by the warpgroup's first thread in the epilogue
  if (!job.pending) return;
  const int splits = g.kv_splits, split = static_cast<int>(cute::block_rank_in_cluster());
  const route::SeqInfo si = job.si;
  const MergeRows rows(si, job.q_begin, tokens, g.packed_heads);
  const int owned = rows.owned(split, splits);
  if (owned == 0) return;
  wait_cluster_release(&inbox.full, 0);
  timeline_mark(timeline, kSplitArrived);
  const int lane = wg_tid % 32;
  const bool varlen = a.route.varlen_q;
  for (int j = wg_tid / 32; j < owned; j += 4) {
    const int k = j * splits + split, token = k % rows.per_head, packed = k / rows.per_head;
    const InboxParts parts{&inbox.o[j * splits][lane * 4], &inbox.lse[j * splits], kHeadDim};
    const MergedRow<kHeadDim> merged(parts, splits, lane);
    const int q = job.q_begin + token;
    merged.store(g, varlen ? 0 : job.b, varlen ? si.q_base + q : q, job.head + packed, lane);
  }
  timeline_mark(timeline, kSplitMerged);
}

}  // namespace bsattn::gpu::fwd
