// Work order of the persistent kernel. A work item is (route row, query head(s) of the row's
// sparsity head: one, or two with GQA packing or a CTA pair); items are numbered in the rows' work
// order (row_order, sorted on the device after route preparation: rows grouped by the KV head
// whose K/V they read, longest first inside a group; prepare_routes.cu); where a row's heads span
// several KV heads, windows of rows that keep the CTAs balanced go KV head by KV head
// (work_items.hpp: kv_major_window).
// A CTA starts with item blockIdx.x and then takes the next unclaimed item from a global counter:
// long rows start first and short ones fill the tail, whatever the sparsity pattern. The two CTAs
// of a pair must walk the same items, so clusters take a static share instead: the work order is
// cut into groups of `clusters` items and cluster c takes the c-th item of even groups and
// the c-th from the end of odd ones (a plain round robin gave the first clusters the longest item of
// every group).
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/work_items.hpp"

namespace bsattn::gpu::fwd {

// The work items a kernel visits: those of the work order's live rows (AttentionParams::live_rows,
// read on the device once its preparation has run).
__device__ __forceinline__ int live_work_items(const AttentionParams& a, int heads_per_tile, int splits = 1) {
  const int items = work_items(a, heads_per_tile, splits);
  if (!a.row_order || !a.live_rows) return items;
  return min(items, *a.live_rows * (a.route.heads_q / a.route.sparsity_heads / heads_per_tile) * splits);
}

// One work item, decoded: where its rows and routes are.
struct Tile {
  int written;  // the slot holds a tile (0 until the producer's first write)
  int item;   // work item (the CTA's next one follows from it)
  int row;    // route row: (b * Hs + hs) * max_q_tiles + q_tile
  int head;   // (first) query head
  int hkv;    // its KV head
  int b;      // sequence
  int q0;     // first query row (sequence-local)
  int count;  // pipeline steps: exact routes (or pairs: Traits::kRoutesPerStep), then proxy windows (0 past the end)
  int first;  // pipeline position of the first route: routes of this CTA's earlier tiles
  int exact;  // exact routes (the proxy records follow them in the row)
  int proxies;  // proxy records (proxy kernels; else 0)
  int window0;  // proxy kernels: the first proxy window, kBlockN KV blocks from window0 * kBlockN (proxy.cuh)
  int split;    // share of the row's routes (decode split-KV; else 0)
  int route0;   // the row's route index of routes[0] (its split's first)
  route::SeqInfo si;
  const route::Route* routes;  // null: routes that follow from the lengths (route_at)
};

// First row (in the route tile) and query head of consumer warpgroup `wg`: without packing the
// warpgroups split the tile's rows, with it (Traits::kHeadsPerTile 2) they take one head each; the
// two CTAs of a pair take one head each (`pair_rank`).
template <class T>
__host__ __device__ __forceinline__ int warpgroup_row0(int wg) {
  return T::kHeadsPerTile == 1 ? wg * 64 : 0;
}
template <class T>
__host__ __device__ __forceinline__ int warpgroup_head(const Tile& tile, int wg, int pair_rank) {
  return tile.head + (T::kHeadsPerTile == 1 ? 0 : wg) + pair_rank;
}

// Written field by field into the shared slot `t` as each is known: built in registers first, the
// whole tile stayed live in the 40-register producer and spilled. The item, the KV head and the
// pipeline position are kept in the slot for the same reason (registers held across the
// producer's tile loop spilled). Two parts: where the tile is (place_tile: the item's row, heads,
// sequence and first query; nothing route preparation writes unless rows were sorted) and its
// routes (tile_routes: the row's count, written by route preparation), so that a decode kernel
// can load the first tile's Q while preparation still runs.
// `splits` > 1 (decode): the splits of one (row, head group) are adjacent items; split s takes
// routes [s * ceil(n / splits), +ceil(n / splits)) of the row's n, possibly none.
// `items`: the launch's live items (live_work_items); `concurrent`: the items in flight at once
// (the CTAs, or clusters, of the launch; item_window); `counts_ready`: route preparation's counts
// may be read (it ran, and the caller waited for it); kPair: the items are the CTA pairs' static
// share (next_item).
template <bool kPair>
__device__ __forceinline__ void place_tile(const AttentionParams& a, int item, int items, int heads_per_tile,
                                           int concurrent, bool counts_ready, Tile& t, int splits = 1) {
  const route::RouteParams& p = a.route;
  const int unit = item / splits, units_in_flight = max(concurrent / splits, 1);
  const ItemWindow w = item_window(p, heads_per_tile, unit, items / splits, units_in_flight);
  const auto order = [&](int i) { return a.row_order ? a.row_order[i] : i; };  // null: index order
  const bool kv_major =
      w.per_kv < w.per_row && counts_ready && kv_major_window<kPair>(a, w, units_in_flight, order);
  const ItemPlace at = item_place(w, heads_per_tile, unit, kv_major);
  const int row = order(at.order_index);
  t.item = item;
  t.row = row;
  t.split = item % splits;
  const route::RowCoordinates rc = route::row_coordinates(p, row);
  const int head = rc.hs * (p.heads_q / p.sparsity_heads) + at.head_offset;
  t.head = head;
  t.hkv = head / (p.heads_q / p.heads_kv);
  t.b = rc.b;
  t.q0 = rc.q_tile * p.tile_m;
  t.si = route::seq_info(p, rc.b);
}

// `first`: the tile's pipeline position; `proxy_columns`: KV blocks of a proxy window (the
// kernel's kBlockN), 0 in a kernel without proxy compensation. `from_lengths`: no route preparation ran,
// the row's routes are its sequence's first prefix_tiles KV tiles (route_at). `routes_per_step`:
// the kernel's Traits::kRoutesPerStep (exact routes per pipeline step).
__device__ __forceinline__ void tile_routes(const AttentionParams& a, int first, Tile& t, int proxy_columns = 0,
                                            int splits = 1, bool from_lengths = false, int routes_per_step = 1) {
  const int row = t.row;
  int records = 0;
  if (from_lengths) {
    t.routes = nullptr;
    if (t.q0 < t.si.seqlen_q) records = route::prefix_tiles(a.route, t.si, t.q0);
  } else {
    t.routes = a.routes + static_cast<std::int64_t>(row) * a.route.capacity;
    if (t.q0 < t.si.seqlen_q) records = a.route_counts[row];
  }
  t.route0 = 0;
  if (splits > 1) {  // no proxy records in a decode kernel
    const int share = (records + splits - 1) / splits, begin = min(records, t.split * share);
    if (t.routes) t.routes += begin;
    t.route0 = begin;
    records = min(records - begin, share);
  }
  const int proxies = proxy_columns > 0 && records > 0 ? a.route_proxy_counts[row] : 0;
  t.exact = records - proxies;
  t.proxies = proxies;
  int windows = 0;  // the windows from the first proxy record's to the last's (records in block order)
  if (proxies > 0) {
    const int window0 = t.routes[t.exact].index / proxy_columns;
    t.window0 = window0;
    windows = t.routes[records - 1].index / proxy_columns - window0 + 1;
  }
  t.count = (t.exact + routes_per_step - 1) / routes_per_step + windows;
  t.first = first;
}

// Pipeline steps of a tile's exact routes: one route per step, or two (route pairs).
template <int kRoutesPerStep>
__device__ __forceinline__ int exact_step_count(const Tile& t) {
  return (t.exact + kRoutesPerStep - 1) / kRoutesPerStep;
}

// First KV block of proxy step `step` (>= the exact steps) of a proxy kernel: its window's first
// summary row.
template <int kBlockN, int kRoutesPerStep>
__device__ __forceinline__ int proxy_window_row(const Tile& t, int step) {
  return (t.window0 + step - exact_step_count<kRoutesPerStep>(t)) * kBlockN;
}

// Route i of a tile. Made from the lengths (t.routes null; only in kernels built with
// kFromLengths): KV tile route0 + i for the tile's one Q unit, masked where the positional mask
// (the only one: route::routes_follow_lengths) cuts it for the unit's rows, as route preparation
// classifies it. The rectangle is never empty: i < prefix_tiles.
__device__ __forceinline__ int route_index(const Tile& t, int i) { return t.routes ? t.routes[i].index : t.route0 + i; }
// One 8-byte global load of a record (through the slot's pointer the compiler saw a generic
// address: a word load and two byte loads, each a generic LD), cached in L1: sixteen records share
// a line. Taken from L2 every step (ld.global.cg) they cost the decode rows with stored routes
// 7-10 % (bench/RESULTS.md, 2026-12-04 13:43-14:17); the grid-dependency wait precedes every read.
__device__ __forceinline__ route::Route load_route(const route::Route* r) {
  const uint2 w = __ldca(reinterpret_cast<const uint2*>(r));
  route::Route out;
  out.index = static_cast<std::int32_t>(w.x);
  out.kind = static_cast<std::uint8_t>(w.y);
  out.rows = static_cast<std::uint8_t>(w.y >> 8);
  out.masked = static_cast<std::uint8_t>(w.y >> 16);
  out.reserved = static_cast<std::uint8_t>(w.y >> 24);
  return out;
}
// `routes`: the tile's `routes`, held by the caller in a register (the slot's copy is reloaded
// after every barrier wait).
template <bool kFromLengths>
__device__ __forceinline__ route::Route route_at(const AttentionParams& a, const Tile& t, const route::Route* routes,
                                                 int i) {
  if (!kFromLengths || routes) return load_route(routes + i);
  const route::RouteParams& p = a.route;
  route::Route r;
  r.index = t.route0 + i;
  r.kind = static_cast<std::uint8_t>(route::RouteKind::exact);
  r.rows = 1;
  const int k0 = r.index * p.tile_n;
  const int q1 = min(t.q0 + p.unit_m, t.si.seqlen_q), k1 = min(k0 + p.tile_n, t.si.seqlen_kv);
  r.masked = route::detail::positional(p, t.si, t.q0, q1, k0, k1) == route::Visibility::partial;
  r.reserved = 0;
  return r;
}

// The exact routes of pipeline step `step`: route `step`, or with route pairs (kRoutes 2) routes
// 2 step and 2 step + 1 of the tile's `exact`; a missing second route has no rows (its half of
// the step is masked whole; its record is the first one's, read again rather than branched on).
template <int kRoutes>
struct StepRoutes {
  route::Route route[kRoutes];
};
template <int kRoutes, bool kFromLengths>
__device__ __forceinline__ StepRoutes<kRoutes> step_routes(const AttentionParams& a, const Tile& t,
                                                           const route::Route* routes, int exact, int step) {
  StepRoutes<kRoutes> s;
  s.route[0] = route_at<kFromLengths>(a, t, routes, kRoutes * step);
  if constexpr (kRoutes == 2) {
    const int second = 2 * step + 1;
    s.route[1] = route_at<kFromLengths>(a, t, routes, min(second, exact - 1));
    if (second >= exact) s.route[1].rows = 0;
  }
  return s;
}

// This CTA's first item, and the one after `current` (of `items`). The counter needs no reset
// before a launch: each CTA starts with item blockIdx.x and claims until a claim fails, so a
// launch makes exactly `items` claims (items - grid that succeed, one failing per CTA), and the
// last of them (the old value items - 1) sets it back to zero for the next launch.
template <bool kPair>
__device__ __forceinline__ int first_item() {
  return kPair ? static_cast<int>(blockIdx.x) / 2 : static_cast<int>(blockIdx.x);
}
template <bool kPair>
__device__ __forceinline__ int next_item(const AttentionParams& a, int current, int items) {
  if constexpr (kPair) {
    const int clusters = static_cast<int>(gridDim.x) / 2, c = static_cast<int>(blockIdx.x) / 2;
    const int group = current / clusters + 1;
    return group * clusters + (group % 2 == 0 ? c : clusters - 1 - c);
  } else {
    const int claimed = atomicAdd(a.work_counter, 1);
    if (claimed == items - 1) atomicExch(a.work_counter, 0);
    return claimed + static_cast<int>(gridDim.x);
  }
}

}  // namespace bsattn::gpu::fwd
