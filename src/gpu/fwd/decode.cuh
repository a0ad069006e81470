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
// arrive merges every split's rows into the result (merge::Accumulator, splits in order: what
// merge_states computes) and sets the count back to zero for the next launch. This replaced a
// merge_states launch after the kernel: 7 us of a 42 us B = 1 decode step on the H200, mostly its
// launch and four tiny blocks' dependent loads. The partials are read through L2 (ld.global.cg):
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

template <int kHeadDim>
__device__ __forceinline__ void merge_splits(const AttentionParams& a, const DecodeGeometry& g, SplitMerge& job,
                                             int tokens, int wg_tid, int barrier_id,
                                             std::uint64_t* timeline = nullptr) {
  __threadfence();  // this thread's partial stores, before the arrival below is seen
  barrier_sync(barrier_id, 128);
  if (!job.pending) return;
  if (wg_tid == 0) {
    const bool is_last = atomicAdd(&g.split_arrivals[job.unit], 1) == g.kv_splits - 1;
    if (is_last) {
      g.split_arrivals[job.unit] = 0;
      __threadfence();  // the other splits' stores, before the reads below
    }
    job.last = is_last;
  }
  barrier_sync(barrier_id, 128);
  timeline_mark(timeline, kSplitArrived);
  if (!job.last) return;
  const route::SeqInfo si = job.si;
  const int b = job.b, h = job.head, q_begin = job.q_begin;
  // Rows of the tile inside the sequence: `rows_per_head` tokens of each of the packed heads.
  const int rows_per_head = min(tokens, si.seqlen_q - q_begin), heads = 64 / tokens;
  constexpr int kChunks = kHeadDim / 4;  // float4 per row
  constexpr int kBatch = 16;             // splits whose loads are in flight together (8: 3.5 us per merge)
  const float* parts = static_cast<const float*>(a.out);
  const bool varlen = a.route.varlen_q;
  for (int idx = wg_tid; idx < rows_per_head * heads * kChunks; idx += 128) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const int q = q_begin + row % rows_per_head, head = h + row / rows_per_head;
    const std::int64_t o_at = a.out_offset(b, si, q, head) + chunk * 4, l_at = a.lse_offset(b, si, q, head);
    merge::Accumulator acc;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < g.kv_splits; s0 += kBatch) {
      float lse[kBatch];
      float4 x[kBatch];
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        if (s0 + j >= g.kv_splits) break;
        lse[j] = __ldcg(a.lse + (s0 + j) * g.lse_split_step + l_at);
        x[j] = __ldcg(reinterpret_cast<const float4*>(parts + (s0 + j) * g.out_split_step + o_at));
      }
      CUTE_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        if (s0 + j >= g.kv_splits) break;
        float weight;
        const float rescale = acc.add(lse[j], weight);
        if (rescale != 1.0f) o = make_float4(o.x * rescale, o.y * rescale, o.z * rescale, o.w * rescale);
        if (weight != 0.0f)
          o = make_float4(o.x + weight * x[j].x, o.y + weight * x[j].y, o.z + weight * x[j].z, o.w + weight * x[j].w);
      }
    }
    const float inv = acc.inv_sum();
    const std::int64_t rb = varlen ? 0 : b, rq = varlen ? si.q_base + q : q;
    char* out = static_cast<char*>(g.result.out);
    const std::int64_t at = g.result.out_offset(rb, rq, head) + chunk * 4;
    switch (g.result_type) {
      case ElementType::f32:
        *reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + at) =
            make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        break;
      case ElementType::f16: {
        const __half2 lo = __floats2half2_rn(o.x * inv, o.y * inv), hi = __floats2half2_rn(o.z * inv, o.w * inv);
        uint2 v;
        v.x = *reinterpret_cast<const unsigned*>(&lo);
        v.y = *reinterpret_cast<const unsigned*>(&hi);
        *reinterpret_cast<uint2*>(reinterpret_cast<__half*>(out) + at) = v;
        break;
      }
      case ElementType::bf16: {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x * inv, o.y * inv);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(o.z * inv, o.w * inv);
        uint2 v;
        v.x = *reinterpret_cast<const unsigned*>(&lo);
        v.y = *reinterpret_cast<const unsigned*>(&hi);
        *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(out) + at) = v;
        break;
      }
    }
    if (chunk == 0 && g.result.lse) g.result.lse[g.result.lse_offset(rb, rq, head)] = acc.lse();
  }
  timeline_mark(timeline, kSplitMerged);
}

}  // namespace bsattn::gpu::fwd
