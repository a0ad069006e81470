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
        c.all_ = true;
        break;
      case SetFormat::block_lists:
        if (!set.counts) break;
        c.count_ = set.counts[bs * set.count_stride[0] + hs * set.count_stride[1] + qb * set.count_stride[2]];
        c.list_ = set.indices + bs * set.index_stride[0] + hs * set.index_stride[1] + qb * set.index_stride[2];
        c.list_stride_ = set.index_stride[3];
        break;
      case SetFormat::varlen_block_lists:
        if (!set.counts) break;
        c.count_ = set.counts[hs * set.count_stride[0] + (s.m_block_base + qb) * set.count_stride[1]];
        c.list_ = set.indices + hs * set.index_stride[0] +
                  (s.idx_base + static_cast<std::int64_t>(qb) * s.kv_blocks) * set.index_stride[1];
        c.list_stride_ = set.index_stride[1];
        break;
      case SetFormat::bsr: {
        if (!set.indptr) break;
        const std::int64_t r =
            p.varlen_q ? static_cast<std::int64_t>(hs) * p.cu_total_m_blocks[p.batch] + s.m_block_base + qb
                       : (static_cast<std::int64_t>(bs) * p.sparsity_heads + hs) * p.max_q_blocks + qb;
        c.list_ = set.indices + set.indptr[r];
        c.count_ = set.indptr[r + 1] - set.indptr[r];
        c.list_stride_ = 1;
        break;
      }
      case SetFormat::bitmask:
        if (!set.bits) break;
        c.words_ = p.varlen_q ? set.bits + hs * set.bits_stride[0] + (s.m_block_base + qb) * set.bits_stride[1]
                              : set.bits + bs * set.bits_stride[0] + hs * set.bits_stride[1] + qb * set.bits_stride[2];
        c.word_stride_ = p.varlen_q ? set.bits_stride[2] : set.bits_stride[3];
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
    if (all_) {
      const int next = last == kEnd ? 0 : last + 1;
      if (next < kv_blocks_) current_ = next;
    } else if (words_) {
      int bit = last == kEnd ? 0 : last + 1;
      while (bit < kv_blocks_) {
        const std::uint32_t word = words_[(bit / 32) * word_stride_] >> (bit % 32);
        if (word) {
          bit += count_trailing_zeros(word);
          if (bit < kv_blocks_) current_ = bit;
          break;
        }
        bit = (bit / 32 + 1) * 32;
      }
    } else {
      while (pos_ < count_) {
        const int index = list_[pos_++ * list_stride_];
        if (index >= 0 && index < kv_blocks_ && (last == kEnd || index > last)) {
          current_ = index;
          break;
        }
      }
    }
  }

  BSATTN_HD void skip_to(int block) {
    while (current_ < block) advance();
  }

 private:
  const std::int32_t* list_ = nullptr;
  std::int64_t list_stride_ = 1;
  int count_ = 0;
  int pos_ = 0;
  const std::uint32_t* words_ = nullptr;
  std::int64_t word_stride_ = 1;
  bool all_ = false;
  int kv_blocks_ = 0;
  int current_ = kEnd;
};

// The selected blocks of one Q unit: partial and full sets merged in ascending order.
struct UnitSelection {
  BlockCursor partial, full;

  BSATTN_HD int current() const {
    return partial.current() < full.current() ? partial.current() : full.current();
  }
  // Kind of `block` if it is the current one; a block in both sets counts as full.
  BSATTN_HD bool is_full(int block) const { return full.current() == block; }
  BSATTN_HD void skip_past(int block) {
    partial.skip_to(block + 1);
    full.skip_to(block + 1);
  }
};

// Used when no custom mask is given: the built-in classification is the whole truth.
struct NoCustomMask {
  BSATTN_HD bool keeps_whole(int, int, int, int, int, int) const { return true; }
};

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

// Prepares route row `row` into out[0, capacity). Returns the number of routes the row needs;
// a value above p.capacity means overflow (records past the capacity are not written).
template <class CustomMask = NoCustomMask>
BSATTN_HD int prepare_row(const RouteParams& p, int row, Route* out, const CustomMask& custom = CustomMask()) {
  const RowCoordinates rc = row_coordinates(p, row);
  const SeqInfo s = seq_info(p, rc.b);
  const int q0 = rc.q_tile * p.tile_m;
  if (q0 >= s.seqlen_q) return 0;

  const int units_per_tile = p.tile_m / p.unit_m;
  int units = 0;
  UnitSelection sel[kMaxUnitsPerTile];
  int unit_q0[kMaxUnitsPerTile];
  for (int u = 0; u < units_per_tile; ++u) {
    unit_q0[u] = q0 + u * p.unit_m;
    if (unit_q0[u] >= s.seqlen_q) break;
    const int qb = unit_q0[u] / p.block_q;
    sel[u].partial = p.has_partial ? BlockCursor::open(p, p.partial, s, rc.b, rc.hs, qb) : BlockCursor();
    sel[u].full = p.has_full ? BlockCursor::open(p, p.full, s, rc.b, rc.hs, qb) : BlockCursor();
    ++units;
  }

  int count = 0;
  const auto emit = [&](int index, RouteKind kind, unsigned rows, unsigned masked) {
    if (count < p.capacity) {
      Route r;
      r.index = index;
      r.kind = static_cast<std::uint8_t>(kind);
      r.rows = static_cast<std::uint8_t>(rows);
      r.masked = static_cast<std::uint8_t>(masked);
      r.reserved = 0;
      out[count] = r;
    }
    ++count;
  };

  // Exact routes: the union over units of their selected blocks, each split into KV tiles.
  const int split = p.block_kv / p.tile_n;
  for (;;) {
    int block = BlockCursor::kEnd;
    for (int u = 0; u < units; ++u) block = sel[u].current() < block ? sel[u].current() : block;
    if (block == BlockCursor::kEnd) break;
    unsigned full_units = 0, partial_units = 0;
    for (int u = 0; u < units; ++u) {
      if (sel[u].current() != block) continue;
      if (sel[u].is_full(block)) full_units |= 1u << u;
      else partial_units |= 1u << u;
      sel[u].skip_past(block);
    }
    for (int t = 0; t < split; ++t) {
      const int k0 = block * p.block_kv + t * p.tile_n;
      if (k0 >= s.seqlen_kv) break;
      unsigned rows = full_units, masked = 0;
      for (int u = 0; u < units; ++u) {
        if (!((partial_units >> u) & 1u)) continue;
        const Visibility v = classify(p, s, rc.b, unit_q0[u], unit_q0[u] + p.unit_m, k0, k0 + p.tile_n);
        if (v == Visibility::empty) continue;
        rows |= 1u << u;
        if (v == Visibility::partial) masked |= 1u << u;
      }
      if (rows) emit(block * split + t, RouteKind::exact, rows, masked);
    }
  }

  // Proxy routes: unselected blocks, eligible per whole Q block (SPEC §6), after the exact ones.
  if (p.proxy_mode != 0) {
    BlockCursor explicit_set[kMaxUnitsPerTile];
    for (int u = 0; u < units; ++u) {
      const int qb = unit_q0[u] / p.block_q;
      sel[u].partial = p.has_partial ? BlockCursor::open(p, p.partial, s, rc.b, rc.hs, qb) : BlockCursor();
      sel[u].full = p.has_full ? BlockCursor::open(p, p.full, s, rc.b, rc.hs, qb) : BlockCursor();
      if (p.proxy_mode == 2) explicit_set[u] = BlockCursor::open(p, p.proxy, s, rc.b, rc.hs, qb);
    }
    for (int block = 0; block < s.kv_blocks; ++block) {
      unsigned rows = 0;
      const int k0 = block * p.block_kv, k1 = k0 + p.block_kv;
      for (int u = 0; u < units; ++u) {
        sel[u].partial.skip_to(block);
        sel[u].full.skip_to(block);
        if (sel[u].current() == block) continue;  // computed exactly: never counted twice
        bool eligible;
        if (p.proxy_mode == 2) {
          explicit_set[u].skip_to(block);
          eligible = explicit_set[u].current() == block;
        } else {
          const int qb0 = (unit_q0[u] / p.block_q) * p.block_q;
          eligible = classify_builtin(p, s, rc.b, qb0, qb0 + p.block_q, k0, k1) == Visibility::full &&
                     custom.keeps_whole(rc.b, rc.hs, qb0, qb0 + p.block_q < s.seqlen_q ? qb0 + p.block_q : s.seqlen_q,
                                        k0, k1 < s.seqlen_kv ? k1 : s.seqlen_kv);
        }
        if (eligible) rows |= 1u << u;
      }
      if (rows) emit(block, RouteKind::proxy, rows, 0);
    }
  }
  return count;
}

}  // namespace bsattn::route
