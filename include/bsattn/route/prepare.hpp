// Route preparation: every input format (SPEC §3) into the route stream (SPEC §5). One body of
// code, compiled for the host (CPU engine) and the device (GPU preparation kernel).
#pragma once
#include <cstdint>

#include "bsattn/route/mask.hpp"
#include "bsattn/route/params.hpp"
#include "bsattn/route/route.hpp"

namespace bsattn::route {

BSATTN_HD int count_trailing_zeros(std::uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
}

// The lanes that hold one cursor, identical in each, and read a list's entries together:
// OneLane for a thread of its own (the CPU engine); the GPU kernel passes its warp
// (prepare_routes.cu). scan_max(v): the max of v over the lanes below (-1 for none) and,
// in *all, over every lane.
struct OneLane {
  static constexpr int kSize = 1;
  BSATTN_HD int lane() const { return 0; }
  BSATTN_HD unsigned ballot(bool b) const { return b ? 1u : 0u; }
  BSATTN_HD int shfl(int v, int) const { return v; }
  BSATTN_HD std::uint32_t reduce_or(std::uint32_t v) const { return v; }
  BSATTN_HD int scan_max(int v, int* all) const {
    *all = v;
    return -1;
  }
};

// Walks one row of one block set in ascending order. Entries that are out of range or not
// strictly ascending are dropped, so even unvalidated metadata cannot drive reads out of bounds
// of the KV sequence.
class BlockCursor {
 public:
  static constexpr int kEnd = 0x7fffffff;

  BSATTN_HD static BlockCursor open(const RouteParams& p, const BlockSetParams& set, const SeqInfo& s, int b,
                                    int hs, int qb) {
    BlockCursor c;
    c.kv_blocks_ = s.kv_blocks;
    const int bs = p.sparsity_batch == 1 ? 0 : b;
    switch (p.format) {
      case SetFormat::all_blocks:
        c.kind_ = Kind::all;
        break;
      case SetFormat::block_lists:
        if (!set.counts) break;
        c.kind_ = Kind::list;
        c.count_ = set.counts[bs * set.count_stride[0] + hs * set.count_stride[1] + qb * set.count_stride[2]];
        c.list_ = set.indices + bs * set.index_stride[0] + hs * set.index_stride[1] + qb * set.index_stride[2];
        c.stride_ = set.index_stride[3];
        break;
      case SetFormat::varlen_block_lists:
        if (!set.counts) break;
        c.kind_ = Kind::list;
        c.count_ = set.counts[hs * set.count_stride[0] + (s.m_block_base + qb) * set.count_stride[1]];
        c.list_ = set.indices + hs * set.index_stride[0] +
                  (s.idx_base + static_cast<std::int64_t>(qb) * s.kv_blocks) * set.index_stride[1];
        c.stride_ = set.index_stride[1];
        break;
      case SetFormat::bsr: {
        if (!set.indptr) break;
        const std::int64_t r =
            p.varlen_q ? static_cast<std::int64_t>(hs) * p.cu_total_m_blocks[p.batch] + s.m_block_base + qb
                       : (static_cast<std::int64_t>(bs) * p.sparsity_heads + hs) * p.max_q_blocks + qb;
        c.kind_ = Kind::list;
        c.list_ = set.indices + set.indptr[r];
        c.count_ = set.indptr[r + 1] - set.indptr[r];
        c.stride_ = 1;
        break;
      }
      case SetFormat::bitmask:
        if (!set.bits) break;
        c.kind_ = Kind::words;
        c.words_ = p.varlen_q ? set.bits + hs * set.bits_stride[0] + (s.m_block_base + qb) * set.bits_stride[1]
                              : set.bits + bs * set.bits_stride[0] + hs * set.bits_stride[1] + qb * set.bits_stride[2];
        c.stride_ = p.varlen_q ? set.bits_stride[2] : set.bits_stride[3];
        break;
    }
    // A valid list is ascending, unique and non-negative, so its in-range entries are among its
    // first nKB; reading no further keeps a bad count inside the row's nKB slots (varlen lists).
    if (c.count_ < 0) c.count_ = 0;
    if (c.count_ > s.kv_blocks) c.count_ = s.kv_blocks;
    if (set.list_length > 0 && c.count_ > set.list_length) c.count_ = set.list_length;
    c.advance();
    return c;
  }

  BSATTN_HD int current() const { return current_; }

  BSATTN_HD void advance() {
    const int last = current_;
    current_ = kEnd;
    if (kind_ == Kind::all) {
      const int next = last == kEnd ? 0 : last + 1;
      if (next < kv_blocks_) current_ = next;
    } else if (kind_ == Kind::words) {
      int bit = last == kEnd ? 0 : last + 1;
      while (bit < kv_blocks_) {
        const std::uint32_t word = words_[(bit / 32) * stride_] >> (bit % 32);
        if (word) {
          bit += count_trailing_zeros(word);
          if (bit < kv_blocks_) current_ = bit;
          break;
        }
        bit = (bit / 32 + 1) * 32;
      }
    } else if (kind_ == Kind::list) {
      while (pos_ < count_) {
        const int index = list_[pos_++ * stride_];
        if (index >= 0 && index < kv_blocks_ && (last == kEnd || index > last)) {
          current_ = index;
          break;
        }
      }
    }
  }

  // To the first block >= `block`: one advance() from block - 1. For a list this consumes the
  // same entries as advancing one block at a time: every entry taken before the first in-range
  // one >= block is below block, so "above the last taken" and "at or above block" agree there.
  BSATTN_HD void skip_to(int block) {
    if (current_ < block) {
      current_ = block - 1;
      advance();
    }
  }

  // The set's blocks in [c0, c0 + 32) as bits (bit i: block c0 + i), leaving the cursor past them.
  // Chunks are taken in ascending order. All blocks and bitmasks take the word at once (building
  // it one advance() per set block made a dense row of 1024 blocks 1024 dependent steps: 63 us
  // for the GPU kernel); a list's entries are read Lanes::kSize at a time (take_list_word).
  template <class Lanes = OneLane>
  BSATTN_HD std::uint32_t take_word(int c0, const Lanes& lanes = Lanes()) {
    if (kind_ == Kind::list) return take_list_word(c0, lanes);
    skip_to(c0);
    if (current_ >= c0 + 32) return 0u;  // kEnd included
    std::uint32_t word = ~0u;
    if (kind_ == Kind::words) {
      const int w = c0 / 32, shift = c0 % 32;
      word = words_[w * stride_] >> shift;
      if (shift && (w + 1) * 32 < kv_blocks_) word |= words_[(w + 1) * stride_] << (32 - shift);
    }
    word &= ~0u << (current_ - c0);  // the blocks before current_ are taken already
    if (kv_blocks_ - c0 < 32) word &= (1u << (kv_blocks_ - c0)) - 1u;
    current_ = c0 + 31;
    advance();
    return word;
  }

  // take_word of a list: skip_to(c0), then advance() while below c0 + 32, on kSize entries per
  // step. An entry is taken when in range and above the cursor's floor (c0 - 1 while skipping,
  // else current_) and above every in-range entry read before it: advance()'s rule, as the
  // last block taken is the largest in-range entry so far. The first entry taken at or past
  // c0 + 32 becomes current_; the entries after it stay unread.
  template <class Lanes>
  BSATTN_HD std::uint32_t take_list_word(int c0, const Lanes& lanes) {
    if (current_ >= c0 + 32) return 0u;  // kEnd included
    std::uint32_t word = 0;
    int floor = c0 - 1;
    if (current_ >= c0) {
      word = 1u << (current_ - c0);
      floor = current_;
    }
    current_ = kEnd;
    for (; pos_ < count_; pos_ += Lanes::kSize) {
      const int i = pos_ + lanes.lane();
      int v = i < count_ ? list_[i * stride_] : -1;
      if (v >= kv_blocks_) v = -1;  // -1: out of range (never taken)
      int all;
      const int below = lanes.scan_max(v, &all);
      const bool taken = v > floor && v > below;
      const unsigned past = lanes.ballot(taken && v >= c0 + 32);
      const int stop = past ? count_trailing_zeros(past) : Lanes::kSize;
      word |= lanes.reduce_or(taken && lanes.lane() < stop ? 1u << (v - c0) : 0u);
      if (past) {
        current_ = lanes.shfl(v, stop);
        pos_ += stop + 1;
        return word;
      }
      if (all > floor) floor = all;
    }
    pos_ = count_;
    return word;
  }

 private:
  enum class Kind : std::uint8_t { none, all, words, list };
  union {  // by kind_
    const std::int32_t* list_ = nullptr;
    const std::uint32_t* words_;
  };
  std::int64_t stride_ = 1;  // between list entries or bitmask words
  int count_ = 0;
  int pos_ = 0;
  int kv_blocks_ = 0;
  int current_ = kEnd;
  Kind kind_ = Kind::none;
};

// Used when no custom mask is given: the built-in classification is the whole truth.
struct NoCustomMask {
  BSATTN_HD bool keeps_whole(int, int, int, int, int, int) const { return true; }
};

// Routes that follow from the sequence lengths. With every block selected (all_blocks), no
// proxy, one Q unit per tile, and a mask that is positional only and without a left window bound
// (none, causal in either alignment, a right window, sinks), the keys a query row sees are a
// prefix of its sequence that grows with the row: the routes of a route row are exactly its first
// prefix_tiles KV tiles, each taken by the unit, masked where the mask cuts it (what
// prepare_row writes). The GPU decode kernel then makes its routes itself and route preparation
// is not launched (a B = 1 decode step waited 6-15 us for it on the H200).
BSATTN_HD bool routes_follow_lengths(const RouteParams& p) {
  return p.format == SetFormat::all_blocks && p.proxy_mode == 0 && !p.has_full && p.tile_m == p.unit_m &&
         p.window_left < 0 && !p.doc_q && !p.kv_valid && !p.custom_mask;
}

// The KV tiles seen by a route tile's rows [q0, q0 + tile_m) under routes_follow_lengths: up to
// the last row's last visible key (its window end or last sink, whichever is later).
BSATTN_HD int prefix_tiles(const RouteParams& p, const SeqInfo& s, int q0) {
  const int last_q = (q0 + p.tile_m < s.seqlen_q ? q0 + p.tile_m : s.seqlen_q) - 1;
  if (last_q < q0) return 0;
  const PositionalBounds b = positional_bounds(p, s, last_q);
  int last_key = b.window_hi > b.sink_end - 1 ? b.window_hi : b.sink_end - 1;
  if (last_key > s.seqlen_kv - 1) last_key = s.seqlen_kv - 1;
  return last_key < 0 ? 0 : last_key / p.tile_n + 1;
}

struct RowCoordinates {
  int b, hs, q_tile;
};

BSATTN_HD RowCoordinates row_coordinates(const RouteParams& p, int row) {
  RowCoordinates c;
  c.q_tile = row % p.max_q_tiles;
  const int bh = row / p.max_q_tiles;
  c.hs = bh % p.sparsity_heads;
  c.b = bh / p.sparsity_heads;
  return c;
}

// One route row being prepared: its Q units (tile_m / unit_m, fewer at the sequence end; at most
// kUnits) and a cursor per unit over each of its block sets. The row's KV blocks are taken in
// chunks of 32: a chunk's set membership is a word per unit and set (take_chunk), and every block
// of the chunk is then classified on its own (exact_routes, proxy_units). prepare_row walks a
// chunk's blocks in order; the GPU kernel of proxy rows gives each block to a lane of a warp
// (prepare_routes.cu). Loops over units run to the compile-time kUnits, so that on the GPU the
// cursors stay in registers rather than in a local-memory array.
template <int kUnits = kMaxUnitsPerTile>
struct RowState {
  static_assert(kUnits >= 1 && kUnits <= kMaxUnitsPerTile, "units per tile");
  RowCoordinates rc;
  SeqInfo s;
  int units = 0;
  int unit_q0[kUnits];
  BlockCursor partial[kUnits], full[kUnits];
  BlockCursor listed[kUnits];  // the explicit proxy set (proxy_mode 2)
};

// Set membership of one chunk's blocks, bit i for block c0 + i.
template <int kUnits = kMaxUnitsPerTile>
struct ChunkWords {
  std::uint32_t partial[kUnits], full[kUnits], listed[kUnits];
  std::uint32_t selected;  // any unit selects the block (exact routes)
};

// Opens the cursors of every unit at block 0 (again before the proxy pass).
template <int kUnits>
BSATTN_HD void open_cursors(const RouteParams& p, RowState<kUnits>& r) {
  for (int u = 0; u < kUnits; ++u) {
    if (u >= r.units) continue;
    const int qb = r.unit_q0[u] / p.block_q;
    r.partial[u] = p.has_partial ? BlockCursor::open(p, p.partial, r.s, r.rc.b, r.rc.hs, qb) : BlockCursor();
    r.full[u] = p.has_full ? BlockCursor::open(p, p.full, r.s, r.rc.b, r.rc.hs, qb) : BlockCursor();
    if (p.proxy_mode == 2) r.listed[u] = BlockCursor::open(p, p.proxy, r.s, r.rc.b, r.rc.hs, qb);
  }
}

// Sets up row `row` (tile_m / unit_m <= kUnits); false for a tile past its sequence's end.
template <int kUnits>
BSATTN_HD bool open_row(const RouteParams& p, int row, RowState<kUnits>& r) {
  r.rc = row_coordinates(p, row);
  r.s = seq_info(p, r.rc.b);
  const int q0 = r.rc.q_tile * p.tile_m;
  if (q0 >= r.s.seqlen_q) return false;
  r.units = 0;
  for (int u = 0; u < kUnits; ++u) {
    r.unit_q0[u] = q0 + u * p.unit_m;
    if (u == r.units && u < p.tile_m / p.unit_m && r.unit_q0[u] < r.s.seqlen_q) ++r.units;
  }
  open_cursors(p, r);
  return true;
}

// Lanes: those holding r (BlockCursor::take_word), all of them calling.
template <int kUnits, class Lanes = OneLane>
BSATTN_HD void take_chunk(const RouteParams& p, RowState<kUnits>& r, int c0, ChunkWords<kUnits>& w,
                          const Lanes& lanes = Lanes()) {
  w.selected = 0;
  for (int u = 0; u < kUnits; ++u) {
    const bool live = u < r.units;
    w.partial[u] = live ? r.partial[u].take_word(c0, lanes) : 0u;
    w.full[u] = live ? r.full[u].take_word(c0, lanes) : 0u;
    w.listed[u] = live && p.proxy_mode == 2 ? r.listed[u].take_word(c0, lanes) : 0u;
    w.selected |= w.partial[u] | w.full[u];
  }
}

// The exact routes of selected block c0 + i: its KV tiles, each with the units that see any of
// it (a unit whose full set holds the block takes it unmasked; a partial unit as classified).
// emit(index, rows, masked) in ascending tile order.
template <int kUnits, class Emit>
BSATTN_HD void exact_routes(const RouteParams& p, const RowState<kUnits>& r, const ChunkWords<kUnits>& w, int c0,
                            int i, const Emit& emit) {
  unsigned full_units = 0, partial_units = 0;
  for (int u = 0; u < kUnits; ++u) {
    if ((w.full[u] >> i) & 1u) full_units |= 1u << u;
    else if ((w.partial[u] >> i) & 1u) partial_units |= 1u << u;
  }
  const int block = c0 + i, split = p.block_kv / p.tile_n;
  for (int t = 0; t < split; ++t) {
    const int k0 = block * p.block_kv + t * p.tile_n;
    if (k0 >= r.s.seqlen_kv) break;
    unsigned rows = full_units, masked = 0;
    for (int u = 0; u < kUnits; ++u) {
      if (!((partial_units >> u) & 1u)) continue;
      const Visibility v = classify(p, r.s, r.rc.b, r.unit_q0[u], r.unit_q0[u] + p.unit_m, k0, k0 + p.tile_n);
      if (v == Visibility::empty) continue;
      rows |= 1u << u;
      if (v == Visibility::partial) masked |= 1u << u;
    }
    if (rows) emit(block * split + t, rows, masked);
  }
}

// The units for which block c0 + i is a proxy block (SPEC §6): not selected by the unit (never
// counted twice) and eligible, per whole Q block, or named by the explicit set.
template <int kUnits, class CustomMask>
BSATTN_HD unsigned proxy_units(const RouteParams& p, const RowState<kUnits>& r, const ChunkWords<kUnits>& w, int c0,
                               int i, const CustomMask& custom) {
  const int block = c0 + i, k0 = block * p.block_kv, k1 = k0 + p.block_kv;
  unsigned rows = 0;
  for (int u = 0; u < kUnits; ++u) {
    if (u >= r.units || (((w.partial[u] | w.full[u]) >> i) & 1u)) continue;
    bool eligible;
    if (p.proxy_mode == 2) {
      eligible = (w.listed[u] >> i) & 1u;
    } else {
      const int qb0 = (r.unit_q0[u] / p.block_q) * p.block_q;
      eligible = classify_builtin(p, r.s, r.rc.b, qb0, qb0 + p.block_q, k0, k1) == Visibility::full &&
                 custom.keeps_whole(r.rc.b, r.rc.hs, qb0, qb0 + p.block_q < r.s.seqlen_q ? qb0 + p.block_q : r.s.seqlen_q,
                                    k0, k1 < r.s.seqlen_kv ? k1 : r.s.seqlen_kv);
    }
    if (eligible) rows |= 1u << u;
  }
  return rows;
}

// Record `i` of a row into out[0, capacity) (records past the capacity are counted, not written).
BSATTN_HD void put_route(Route* out, int capacity, int i, int index, RouteKind kind, unsigned rows, unsigned masked) {
  if (i >= capacity) return;
  Route r;
  r.index = index;
  r.kind = static_cast<std::uint8_t>(kind);
  r.rows = static_cast<std::uint8_t>(rows);
  r.masked = static_cast<std::uint8_t>(masked);
  r.reserved = 0;
  out[i] = r;
}

// Prepares route row `row` into out[0, capacity). Returns the number of routes the row needs;
// a value above p.capacity means overflow (records past the capacity are not written). Exact
// routes first (the union over units of their selected blocks, ascending, each split into KV
// tiles), then the proxy routes (ascending unselected blocks, SPEC §6). kUnits >= tile_m / unit_m.
template <class CustomMask = NoCustomMask, int kUnits = kMaxUnitsPerTile>
BSATTN_HD int prepare_row(const RouteParams& p, int row, Route* out, const CustomMask& custom = CustomMask()) {
  RowState<kUnits> r;
  if (!open_row(p, row, r)) return 0;
  int count = 0;
  ChunkWords<kUnits> w;
  for (int c0 = 0; c0 < r.s.kv_blocks; c0 += 32) {
    take_chunk(p, r, c0, w);
    for (std::uint32_t bits = w.selected; bits; bits &= bits - 1)
      exact_routes(p, r, w, c0, count_trailing_zeros(bits), [&](int index, unsigned rows, unsigned masked) {
        put_route(out, p.capacity, count++, index, RouteKind::exact, rows, masked);
      });
  }
  if (p.proxy_mode != 0) {
    open_cursors(p, r);
    for (int c0 = 0; c0 < r.s.kv_blocks; c0 += 32) {
      take_chunk(p, r, c0, w);
      for (int i = 0; i < 32 && c0 + i < r.s.kv_blocks; ++i)
        if (const unsigned rows = proxy_units(p, r, w, c0, i, custom))
          put_route(out, p.capacity, count++, c0 + i, RouteKind::proxy, rows, 0);
    }
  }
  return count;
}

}  // namespace bsattn::route
