// The decode policy of the forward kernel (Traits::kDecode). A decode step has one to a few
// queries per sequence and reads a long K/V: the prefill tiles (64 query tokens of one head) would
// leave most rows empty and read every K/V tile once per query head. The decode kernel instead
// fills its one warpgroup's 64 rows with the P query heads of one KV group (P a power of two
// dividing the group, so they share the K/V tiles and the sparsity head) times T = 64 / P tokens:
// row r is token r % T of head r / T (the order a TMA box {D 64, T tokens, P heads} lands in
// shared memory), so each K/V tile is read once per P heads. When (route rows x head groups) do
// not fill the multiprocessors, each is split into `kv_splits` work items over its routes
// (split-KV), whose fp32 partial O and LSE are merged in the kernel (split_merge.cuh). Everything
// else — producer, pipeline, mask, softmax, epilogue — is the prefill kernel's.
#pragma once
#include <cstdint>

#include "api/merge_params.hpp"
#include "gpu/attention.hpp"
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
  // With splits: the kv_splits CTAs of a (route row, head group) form a cluster and merge through
  // distributed shared memory (push_partial, merge_cluster_splits); else through the workspace
  // (merge_splits). Chosen at launch (launch.cuh) where such clusters all fit on the device at once
  // and each merging CTA's parts fit its inbox.
  int cluster_merge = 0;
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

}  // namespace bsattn::gpu::fwd
