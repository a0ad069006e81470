// The walk of one backward CTA (batch b, KV head hkv, KV tile): for each query head of the KV
// head's group, the column of its sparsity head, and in each column entry (a Q tile that takes
// this KV tile) the steps (step_rows query rows: 64, or 128 by backward_step_rows) whose units
// take the route. Every thread walks it alike (host code too: the host tests check the walk
// against the row-major routes).
#pragma once
#include "bsattn/attention_params.hpp"
#include "gpu/backward.hpp"
#include "gpu/prepare_routes.hpp"

namespace bsattn::gpu::bwd {

// Query rows per step of the kernel of KV tile width block_n: 128 where that is 128 and D is 64
// (FlashAttention-3's tile for D 64: N = 128 score GEMMs and half the steps, whose fixed costs
// weigh more beside D 64's GEMMs) and the route's Q tiles are whole steps; else 64.
BSATTN_HD constexpr int backward_step_rows(int head_dim, int block_n, int tile_m) {
  return head_dim == 64 && block_n == 128 && tile_m % 128 == 0 ? 128 : 64;
}

// The CTA a block runs: item (b * Hkv + hkv) * max_kv_tiles + kv_tile, KV tile fastest (the
// block order of deterministic mode).
struct Cta {
  int b, hkv, kv_tile;
  BSATTN_HD static Cta of(int item, int max_kv_tiles, int heads_kv) {
    const int bh = item / max_kv_tiles;
    return {bh / heads_kv, bh % heads_kv, item % max_kv_tiles};
  }
};

// What the kernel derives from its CTA: coordinates, the sequence, the KV tile's rows.
struct CtaExtent : Cta {
  route::SeqInfo si;
  int k0;       // first KV row of the tile
  int n_valid;  // rows of the tile inside the sequence's attended K/V
  // K/V rows the sequence owns: with seqused_k a packed sequence is longer than its attended
  // part, and that tail gets zero gradients (as on the CPU engine).
  int owned;
  BSATTN_HD static CtaExtent of(const route::RouteParams& p, int item, int max_kv_tiles) {
    CtaExtent e;
    static_cast<Cta&>(e) = Cta::of(item, max_kv_tiles, p.heads_kv);
    e.si = route::seq_info(p, e.b);
    e.k0 = e.kv_tile * p.tile_n;
    const int rows_left = e.si.seqlen_kv - e.k0;
    e.n_valid = rows_left < 0 ? 0 : rows_left < p.tile_n ? rows_left : p.tile_n;
    e.owned = p.varlen_kv ? p.cu_seqlens_k[e.b + 1] - p.cu_seqlens_k[e.b] : e.si.seqlen_kv;
    return e;
  }
};

// A CTA's work for the launch order (work_order.cuh): the column entries its walk visits, over the
// query heads of its KV head's group (each entry is one or tile_m / step_rows steps alike).
struct CtaWork {
  const std::int32_t* counts;  // column counts
  int max_kv_tiles, heads_kv, sparsity_heads, group, heads_per_sparsity_head, max_q_tiles;

  static CtaWork of(const route::RouteParams& p, int max_kv_tiles, const std::int32_t* counts) {
    return {counts, max_kv_tiles, p.heads_kv, p.sparsity_heads, p.heads_q / p.heads_kv, p.heads_q / p.sparsity_heads,
            p.max_q_tiles};
  }
  // Groups: one (b, KV head), whose CTAs read the same Q and dO.
  RowOrder order_groups() const { return {max_kv_tiles, group * max_q_tiles}; }
  // Every CTA is launched (the grid is the plan's); one past its sequence's keys exits at once.
  BSATTN_HD bool live(int) const { return true; }
  BSATTN_HD int operator()(int item) const {
    const Cta c = Cta::of(item, max_kv_tiles, heads_kv);
    int entries = 0;
    for (int h = c.hkv * group; h < (c.hkv + 1) * group; ++h)
      entries += counts[(static_cast<std::int64_t>(c.b) * sparsity_heads + h / heads_per_sparsity_head) * max_kv_tiles +
                        c.kv_tile];
    return entries;
  }
};

struct Step {
  int head;    // query head
  int record;  // entry of the head's column
  int sub;     // step of the Q tile (step_rows rows)
  ColumnRoute route;
  int q0;      // first query row of the step (sequence-local)
  unsigned units;  // the Q tile's units that overlap the step's rows (step_units: a division the
                   // consumers then do not repeat per step)
};

struct StepWalk {
  const ColumnRoute* columns;
  const std::int32_t* counts;
  std::int64_t column0;  // column of sparsity head 0: (b * Hs) * max_kv_tiles + kv_tile
  int max_kv_tiles, capacity;
  int head_begin, head_end, heads_per_sparsity_head;
  int tile_m, unit_m, seqlen_q;
  int step_rows;  // query rows per step: 64, or 128 (a divisor of tile_m)

  // The walk of the CTA (b, hkv, kv_tile) over a column stream of max_kv_tiles tiles per
  // (b, hs) and p.max_q_tiles entries per column.
  BSATTN_HD static StepWalk for_cta(const route::RouteParams& p, const ColumnRoute* columns, const std::int32_t* counts,
                                    int max_kv_tiles, int b, int hkv, int kv_tile, int seqlen_q, int step_rows) {
    StepWalk w;
    w.columns = columns;
    w.counts = counts;
    w.column0 = static_cast<std::int64_t>(b) * p.sparsity_heads * max_kv_tiles + kv_tile;
    w.max_kv_tiles = max_kv_tiles;
    w.capacity = p.max_q_tiles;
    const int group = p.heads_q / p.heads_kv;
    w.head_begin = hkv * group;
    w.head_end = w.head_begin + group;
    w.heads_per_sparsity_head = p.heads_q / p.sparsity_heads;
    w.tile_m = p.tile_m;
    w.unit_m = p.unit_m;
    w.seqlen_q = seqlen_q;
    w.step_rows = step_rows;
    return w;
  }

  // Units of the Q tile (unit_m rows each) that overlap step `sub`'s rows. Unsigned: signed
  // divisions by the runtime unit_m add sign fix-ups to the producer's every step.
  BSATTN_HD unsigned step_units(int sub) const {
    const unsigned rows = static_cast<unsigned>(step_rows), unit = static_cast<unsigned>(unit_m);
    const unsigned row = rows * static_cast<unsigned>(sub);
    const unsigned first = row / unit, last = (row + rows - 1u) / unit;
    return ((2u << last) - 1u) & ~((1u << first) - 1u);
  }

  // The first step at or after `sub` of column entry r whose rows start in the sequence and take
  // the route; -1 if none.
  BSATTN_HD int next_sub(const ColumnRoute& r, int sub) const {
    for (; sub * step_rows < tile_m; ++sub) {
      if (r.q_tile * tile_m + sub * step_rows >= seqlen_q) break;
      if (r.rows & step_units(sub)) return sub;
    }
    return -1;
  }
  // Moves s to step `sub` of entry r.
  BSATTN_HD bool take(Step& s, const ColumnRoute& r, int sub) const {
    s.route = r;
    s.sub = sub;
    s.q0 = r.q_tile * tile_m + sub * step_rows;
    s.units = step_units(sub);
    return true;
  }
  // Moves s to the first step at or after (head, record, sub) whose rows lie in the sequence
  // and take the route; false at the end.
  BSATTN_HD bool seek(Step& s) const {
    for (; s.head < head_end; ++s.head, s.record = 0, s.sub = 0) {
      const std::int64_t column =
          column0 + static_cast<std::int64_t>(static_cast<unsigned>(s.head) / heads_per_sparsity_head) * max_kv_tiles;
      const int count = counts[column];
      for (; s.record < count; ++s.record, s.sub = 0) {
        const ColumnRoute r = columns[column * capacity + s.record];
        const int sub = next_sub(r, s.sub);
        if (sub >= 0) return take(s, r, sub);
      }
    }
    return false;
  }
  // Whether s is the last step of its column entry (no later step of the Q tile lies in
  // the sequence and takes the route): the deterministic dQ order moves on after it.
  BSATTN_HD bool last_of_record(const Step& s) const { return next_sub(s.route, s.sub + 1) < 0; }
  BSATTN_HD bool first(Step& s) const {
    s.head = head_begin;
    s.record = 0;
    s.sub = 0;
    return seek(s);
  }
  // The entry's later steps first, from the route s holds: no reload of the column's count and
  // entry (dependent global loads) and no sparsity head division per step.
  BSATTN_HD bool next(Step& s) const {
    const int sub = next_sub(s.route, s.sub + 1);
    if (sub >= 0) return take(s, s.route, sub);
    ++s.record;
    s.sub = 0;
    return seek(s);
  }
};

}  // namespace bsattn::gpu::bwd
