// The work items of the persistent forward kernel and where each one stands, on the host and the
// device (scheduler.cuh decodes an item into its tile; the host tests check the numbering). A work
// item is a route row and heads_per_tile query heads of the row's sparsity head (one, or two with
// GQA packing or a CTA pair), possibly split along its routes (decode split-KV).
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/params.hpp"

namespace bsattn::gpu::fwd {

// `splits`: work items per (route row, head group), each taking a share of the row's routes (the
// decode kernel's split-KV; 1 elsewhere).
BSATTN_HD int work_items(const AttentionParams& a, int heads_per_tile, int splits = 1) {
  return a.route_rows * (a.route.heads_q / a.route.sparsity_heads / heads_per_tile) * splits;
}

// GQA packing applies when consecutive query-head pairs share both their sparsity head (same
// routes) and their KV head (same K/V tiles).
BSATTN_HD bool packable_heads(const route::RouteParams& p) {
  return (p.heads_q / p.sparsity_heads) % 2 == 0 && (p.heads_q / p.heads_kv) % 2 == 0;
}

// Where item group `unit` (an item, or the splits of one) stands among `units` (the launch's live
// ones, whole rows of them): the position of its route row in the work order and the offset of
// its first query head in the row's sparsity head. Rows go in work order (longest first within
// the rows that read one KV head), a row's items adjacent, so that heads sharing K/V tiles run at
// the same time and meet in L2.
//
// Where a sparsity head spans several KV heads (a pattern shared by more query heads than a KV
// group has, and every all_blocks plan), a row's items read several KV heads' K/V, and the items in
// flight read all of them at once (row by row, the dense S 32768 row with one pattern for all
// heads hit L2 in 79 % of its loads and read 9 GB from DRAM; FlashAttention-4 98 % and 0.9 GB:
// bench/RESULTS.md, 2026-12-06 07:38). There the rows are cut into windows of consecutive
// work-order rows holding at least `concurrent` items (the CTAs or pairs in flight) of each KV
// head, and a window may be numbered KV head by KV head (kv_major: its items of the first KV head,
// then of the next), so that the items in flight read one KV head's K/V. The kernel does so only
// where the CTA pairs' static share of the items (scheduler.cuh) stays balanced (kv_major_window):
// with windows of unsorted rows of unequal length, the share took the same rows from every KV
// head's run, and causal S 8192 and the packed documents ran 11 % and 10 % slower (2026-12-06 10:15).
struct ItemWindow {
  int first_row;  // work-order position of the window's first row
  int rows;       // rows in the window
  int per_row;    // items of a row
  int per_kv;     // items of one (row, KV head): per_row unless the row's heads span several KV heads
};
BSATTN_HD ItemWindow item_window(const route::RouteParams& p, int heads_per_tile, int unit, int units,
                                 int concurrent) {
  const int per_row = p.heads_q / p.sparsity_heads / heads_per_tile;
  const int group = p.heads_q / p.heads_kv;
  int per_kv = per_row;  // several KV heads that whole items cover: a KV head's share of the row
  if (group % heads_per_tile == 0 && group / heads_per_tile < per_row && per_row % (group / heads_per_tile) == 0)
    per_kv = group / heads_per_tile;
  const int window_rows = (concurrent > per_kv ? concurrent + per_kv - 1 : per_kv) / per_kv;
  const int first_row = unit / per_row / window_rows * window_rows, rows = units / per_row;
  return {first_row, rows - first_row < window_rows ? rows - first_row : window_rows, per_row, per_kv};
}
struct ItemPlace {
  int order_index;  // into the work order (row_order)
  int head_offset;  // first query head, from the row's sparsity head's first
};
BSATTN_HD ItemPlace item_place(const ItemWindow& w, int heads_per_tile, int unit, bool kv_major) {
  if (!kv_major) return {unit / w.per_row, unit % w.per_row * heads_per_tile};
  const int in_window = unit - w.first_row * w.per_row, run = w.rows * w.per_kv;  // a KV head's items
  const int kv = in_window / run, rest = in_window % run;
  return {w.first_row + rest / w.per_kv, (kv * w.per_kv + rest % w.per_kv) * heads_per_tile};
}

// Whether window `w` goes KV head by KV head: where the items stay balanced across the CTAs.
// Rows as long as each other (the order sorts longest first, so the first and last rows' route
// counts tell) are balanced whatever the numbering. With CTA pairs (kStaticShare: the pairs'
// static share of the items, scheduler.cuh) a full window (runs as long as the pairs in flight)
// sorted longest first is too: each KV head's run is a whole group of the share, which pairs each
// run's c-th longest row with the next run's c-th shortest. It is sorted where its first and last
// rows are of one group of the work order (one sequence and sparsity head; the order sorts a group
// longest first, and groups sorted together share a range of it). Only the pair kernels take such
// windows, as measured (bench/RESULTS.md, 2026-12-06 11:14); for items claimed from the counter a
// model of the claims finds them balanced too (causal S 16384-65536, packed documents), not yet
// timed. `order`: work-order position -> route row.
template <bool kStaticShare, class Order>
BSATTN_HD bool kv_major_window(const AttentionParams& a, const ItemWindow& w, int concurrent, const Order& order) {
  const int first = order(w.first_row), last = order(w.first_row + w.rows - 1);
  if constexpr (kStaticShare) {
    // Route rows are (b * Hs + hs) * max_q_tiles + q_tile.
    if (w.rows * w.per_kv >= concurrent && first / a.route.max_q_tiles == last / a.route.max_q_tiles) return true;
  }
  return a.route_counts[first] == a.route_counts[last];
}

}  // namespace bsattn::gpu::fwd
