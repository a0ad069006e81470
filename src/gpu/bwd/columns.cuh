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
BSATTN_HD int find_route(const route::Route* routes, int count, int tile) {
  int lo = 0, hi = count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (routes[mid].index < tile) lo = mid + 1;
    else hi = mid;
  }
  return lo < count && routes[lo].index == tile ? lo : -1;
}

// The entry of column (bh = b * Hs + hs, kv_tile) for Q tile q_tile, if that row routes to the
// KV tile (host and device: the host tests walk the same code).
BSATTN_HD bool column_entry(const AttentionParams& a, int bh, const route::SeqInfo& si, int kv_tile, int q_tile,
                            ColumnRoute& entry) {
  const route::RouteParams& p = a.route;
  if (q_tile * p.tile_m >= si.seqlen_q) return false;
  const std::int64_t row = static_cast<std::int64_t>(bh) * p.max_q_tiles + q_tile;
  const route::Route* routes = a.routes + row * p.capacity;
  const int position = find_route(routes, a.route_counts[row], kv_tile);
  if (position < 0) return false;
  entry.q_tile = q_tile;
  entry.position = position;
  entry.rows = routes[position].rows;
  entry.masked = routes[position].masked;
  entry.reserved[0] = entry.reserved[1] = 0;
  return true;
}

#if defined(__CUDACC__)
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
    ColumnRoute entry;
    const bool hit = column_entry(a, bh, si, kv_tile, base + lane, entry);
    const unsigned hits = __ballot_sync(0xffffffffu, hit);
    if (hit) dst[count + __popc(hits & ((1u << lane) - 1u))] = entry;
    count += __popc(hits);
  }
  if (lane == 0) counts[column] = count;
}
#endif

}  // namespace bsattn::gpu::bwd
