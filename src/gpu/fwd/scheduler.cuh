// Work order of the persistent kernel. A work item is (route row, query head of the row's
// sparsity head); items are numbered longest row first (row_order, sorted on the device by route
// count after route preparation) with the query heads of one row adjacent, so that heads sharing
// K/V tiles run at the same time and meet in L2. Each CTA starts with item blockIdx.x and then
// takes the next unclaimed item from a global counter: long rows start first and short ones fill
// the tail, whatever the sparsity pattern.
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"

namespace bsattn::gpu::fwd {

__host__ __device__ __forceinline__ int work_items(const AttentionParams& a) {
  return a.route_rows * (a.route.heads_q / a.route.sparsity_heads);
}

// One work item, decoded: where its rows and routes are.
struct Tile {
  int row;    // route row: (b * Hs + hs) * max_q_tiles + q_tile
  int head;   // query head
  int b;      // sequence
  int q0;     // first query row (sequence-local)
  int count;  // routes to walk (0 for a tile past the sequence end)
  route::SeqInfo si;
  const route::Route* routes;
};

__device__ __forceinline__ Tile decode_tile(const AttentionParams& a, int item) {
  const route::RouteParams& p = a.route;
  const int group = p.heads_q / p.sparsity_heads;
  Tile t;
  t.row = a.row_order[item / group];
  const route::RowCoordinates rc = route::row_coordinates(p, t.row);
  t.head = rc.hs * group + item % group;
  t.b = rc.b;
  t.si = route::seq_info(p, rc.b);
  t.q0 = rc.q_tile * p.tile_m;
  t.count = t.q0 < t.si.seqlen_q ? a.route_counts[t.row] : 0;
  t.routes = a.routes + static_cast<std::int64_t>(t.row) * p.capacity;
  return t;
}

// The next item for this CTA after `current` (the first is blockIdx.x).
__device__ __forceinline__ int next_item(const AttentionParams& a) {
  return atomicAdd(a.work_counter, 1) + static_cast<int>(gridDim.x);
}

}  // namespace bsattn::gpu::fwd
