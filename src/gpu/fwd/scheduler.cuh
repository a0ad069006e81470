// Work order: one CTA per (route row, query head of the row's sparsity head). CTAs are issued
// last query tile first (under causal or window masks the late tiles carry the longest route
// lists; starting them first shortens the tail), and the heads of one KV group are adjacent so
// that their shared K/V tiles meet in L2.
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"

namespace bsattn::gpu::fwd {

struct WorkItem {
  int row;  // route row: (b * Hs + hs) * max_q_tiles + q_tile
  int head;  // query head
};

__host__ __device__ __forceinline__ int work_items(const AttentionParams& a) {
  return a.route_rows * (a.route.heads_q / a.route.sparsity_heads);
}

__device__ __forceinline__ WorkItem work_item(const AttentionParams& a, int id) {
  const route::RouteParams& p = a.route;
  const int group = p.heads_q / p.sparsity_heads;
  const int per_tile = p.batch * p.sparsity_heads * group;
  const int q_tile = p.max_q_tiles - 1 - id / per_tile;
  const int rest = id % per_tile;
  const int bhs = rest / group;
  WorkItem w;
  w.row = bhs * p.max_q_tiles + q_tile;
  w.head = (bhs % p.sparsity_heads) * group + rest % group;
  return w;
}

}  // namespace bsattn::gpu::fwd
