// The column-major route stream of the backward (SPEC §9), built on the device from the
// forward's row-major routes with no host sync. One warp per column (b, hs, kv_tile): its lanes
// take 32 Q tiles at a time, find the route to this KV tile in each row by binary search (exact
// routes ascend by KV tile, as prepare_row emits them) and append the hits in ascending Q-tile
// order (ballot + prefix count), so the stream, and with it every dK/dV summation order, is the
// same on every run.
#pragma once
#include "bsattn/attention_params.hpp"
#include "gpu/backward.hpp"

namespace bsattn::gpu::bwd {

// Position of the route to KV tile `tile` in a row, or -1.
__device__ __forceinline__ int find_route(const route::Route* routes, int count, int tile) {
  int lo = 0, hi = count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (routes[mid].index < tile) lo = mid + 1;
    else hi = mid;
  }
  return lo < count && routes[lo].index == tile ? lo : -1;
}

constexpr int kColumnWarps = 4;

__global__ void __launch_bounds__(32 * kColumnWarps)
    build_columns_kernel(const AttentionParams a, int max_kv_tiles, std::int64_t columns, ColumnRoute* out,
                         std::int32_t* counts, const int* overflow) {
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * kColumnWarps + threadIdx.x / 32;
  if (column >= columns) return;
  const int lane = threadIdx.x % 32;
  const route::RouteParams& p = a.route;
  const int kv_tile = static_cast<int>(column % max_kv_tiles);
  const int bh = static_cast<int>(column / max_kv_tiles);  // b * Hs + hs
  const route::SeqInfo si = route::seq_info(p, bh / p.sparsity_heads);
  ColumnRoute* dst = out + column * p.max_q_tiles;
  int count = 0;
  // An overflowing preparation leaves rows incomplete: the backward then writes nothing.
  const bool live = *overflow == 0 && kv_tile * p.tile_n < si.seqlen_kv;
  for (int base = 0; live && base * p.tile_m < si.seqlen_q; base += 32) {
    const int q_tile = base + lane;
    int position = -1;
    route::Route r{};
    if (q_tile * p.tile_m < si.seqlen_q) {
      const std::int64_t row = static_cast<std::int64_t>(bh) * p.max_q_tiles + q_tile;
      const route::Route* routes = a.routes + row * p.capacity;
      position = find_route(routes, a.route_counts[row], kv_tile);
      if (position >= 0) r = routes[position];
    }
    const unsigned hits = __ballot_sync(0xffffffffu, position >= 0);
    if (position >= 0) {
      ColumnRoute c;
      c.q_tile = q_tile;
      c.position = position;
      c.rows = r.rows;
      c.masked = r.masked;
      c.reserved[0] = c.reserved[1] = 0;
      dst[count + __popc(hits & ((1u << lane) - 1u))] = c;
    }
    count += __popc(hits);
  }
  if (lane == 0) counts[column] = count;
}

}  // namespace bsattn::gpu::bwd
