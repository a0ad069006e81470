// Masking of one route's score tile. Full routes (every present unit takes the route unmasked,
// the tile lies inside the sequence) run none of this; otherwise each element checks its unit's
// route bits, the sequence tails and, for partial units, the built-in token mask. The mask's
// values (causal, window, sinks, documents, KV validity) are runtime parameters: one
// instantiation serves every built-in mask.
#pragma once
#include <cmath>

#include <cute/tensor.hpp>

#include "bsattn/attention_params.hpp"
#include "bsattn/route/mask.hpp"

namespace bsattn::gpu::fwd {

using namespace cute;

struct RouteMask {
  int q_begin;      // first query row (sequence-local) of this warpgroup's 64 rows
  int tile_row0;    // row of this warpgroup inside the route tile (0 or 64)
  int k0;           // first KV token of the route
  int n_valid;      // KV tokens in the route tile (tile_n, clipped to the sequence)
  unsigned rows;    // route unit bits
  unsigned masked;
  int unit_m;
  int token_mask = 63;  // row r is token r & token_mask (a decode tile packs heads: decode.cuh)

  // Row r of this warpgroup's tile: its query, whether its unit takes the route inside the
  // sequence, and whether the unit needs the token mask.
  struct Row {
    int q;
    bool takes, partial;
  };
  __device__ __forceinline__ Row row(int r, const route::SeqInfo& si) const {
    r &= token_mask;
    const int q = q_begin + r;
    const int unit = (tile_row0 + r) / unit_m;
    return {q, ((rows >> unit) & 1u) && q < si.seqlen_q, ((masked >> unit) & 1u) != 0};
  }

  // s: scores (rowcol view); c: their (row, col) coordinates in the 64 x N tile (same view).
  // kTokenTensors: the problem has document ids or KV validity bits: in the forward's S fragment
  // (kPairColumns) checked after the positional mask (apply_token_tensors), elsewhere per element
  // by route::token_visible. A kernel policy, not a run-time branch: compiled into one kernel,
  // the tensor path raised the register pressure of the whole main loop (spills everywhere, 15 KB
  // in the 64-wide kernels).
  // kPairColumns: the view's column j lies at c(i, 0) + 8 (j / 2) + j % 2, as the columns of a
  // wgmma accumulator do (the forward's S tile); the positional path then masks a row by bits.
  template <bool kTokenTensors, bool kPairColumns = false, class TS, class TC>
  __device__ __forceinline__ void apply(TS& s, const TC& c, const AttentionParams& a, const route::SeqInfo& si,
                                        int b) const {
    apply_split<kTokenTensors, kPairColumns, decltype(size<1>(s))::value>(*this, *this, s, c, a, si, b);
  }

  // Two routes side by side in one tile (route pairs, Traits::kRoutesPerStep 2): the view's columns
  // j < kSplit are `left`'s, the others `right`'s; each mask's k0 is its route's first token minus
  // its first column, so that k0 + col is the token, and its n_valid counts from column 0.
  // kPairColumns layouts keep column order: j < kSplit is the tile's left half.
  template <bool kTokenTensors, bool kPairColumns, int kSplit, class TS, class TC>
  __device__ __forceinline__ static void apply_split(const RouteMask& left, const RouteMask& right, TS& s, const TC& c,
                                                     const AttentionParams& a, const route::SeqInfo& si, int b) {
    if constexpr (!kTokenTensors || kPairColumns) {
      apply_positional<kPairColumns, kSplit>(left, right, s, c, a.route, si);
      if constexpr (kTokenTensors) apply_token_tensors<kSplit>(left, right, s, c, a.route, si, b);
    } else {
      // The backward's transposed view (many rows, 2 columns a thread): the rows' values held by
      // apply_token_tensors spilled 112-560 bytes there, so each element evaluates the whole mask.
      constexpr int kCols = decltype(size<1>(s))::value;
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const int r = get<0>(c(i, 0));
        const Row rows[2] = {left.row(r, si), right.row(r, si)};
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const RouteMask& m = j < kSplit ? left : right;
          const Row& row = rows[j < kSplit ? 0 : 1];
          const int col = get<1>(c(i, j));
          bool visible = row.takes && col < m.n_valid;
          if (visible && row.partial) visible = route::token_visible(a.route, si, b, row.q, m.k0 + col);
          if (!visible) s(i, j) = -INFINITY;
        }
      }
    }
  }

  // The per-token tensors (document ids, KV validity bits) on the partial rows, after the
  // positional mask has cleared everything else it hides; for the forward's S fragment (2 rows a
  // thread). An accumulator's coordinates are a product (the row from i, the column from j), so
  // each column's values are loaded once for the thread's rows, and no element branches: a branch
  // around route::token_visible per element took ptxas 30-60 s per forward kernel, half the
  // forward's build time.
  template <int kSplit, class TS, class TC>
  __device__ __forceinline__ static void apply_token_tensors(const RouteMask& left, const RouteMask& right, TS& s,
                                                             const TC& c, const route::RouteParams& p,
                                                             const route::SeqInfo& si, int b) {
    constexpr int kRows = decltype(size<0>(s))::value, kCols = decltype(size<1>(s))::value;
    static_assert(kRows <= kCols, "the rows' values are held: a fragment of few rows");
    constexpr int kSides = kSplit < kCols ? 2 : 1;
    const auto mask_of = [&](int side) -> const RouteMask& { return side == 0 ? left : right; };
    bool check[kSides][kRows];
    int q[kSides][kRows];
    bool any = false;
    CUTE_UNROLL
    for (int side = 0; side < kSides; ++side) {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const Row row = mask_of(side).row(get<0>(c(i, 0)), si);
        check[side][i] = row.takes && row.partial;
        q[side][i] = row.q;
        any = any || check[side][i];
      }
    }
    if (!any) return;
    if (p.doc_q) {
      const std::int32_t* doc_q = route::query_documents(p, si, b);
      const std::int32_t* doc_kv = route::kv_documents(p, si, b);
      std::int32_t doc[kSides][kRows];
      CUTE_UNROLL
      for (int side = 0; side < kSides; ++side) {
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i) doc[side][i] = check[side][i] ? doc_q[q[side][i]] : 0;
      }
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const int side = j < kSplit ? 0 : 1;
        const RouteMask& m = mask_of(side);
        const int col = get<1>(c(0, j));
        const std::int32_t d = col < m.n_valid ? doc_kv[m.k0 + col] : 0;
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i)
          if (check[side][i] && d != doc[side][i]) s(i, j) = -INFINITY;
      }
    }
    if (p.kv_valid) {
      const std::uint32_t* words = route::kv_valid_words(p, b);
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const int side = j < kSplit ? 0 : 1;
        const RouteMask& m = mask_of(side);
        const int col = get<1>(c(0, j)), kv = m.k0 + col;
        const bool valid = col < m.n_valid ? ((words[kv / 32] >> (kv % 32)) & 1u) != 0 : false;
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i)
          if (check[side][i] && !valid) s(i, j) = -INFINITY;
      }
    }
  }

  // Causal, window and sinks only (no per-token tensors): the visible KV columns of a row (relative
  // to k0) follow from its diagonal as two intervals, [lo, hi] (the causal limit, the window and
  // the tile's valid columns) and [0, sink_hi] (the sinks, under the same causal and valid limits).
  // Same predicate as route::token_visible: (kv <= diag if causal) && (diag - wl <= kv <= diag + wr
  // || kv < sinks).
  struct Interval {
    int lo, hi, sink_hi;
  };
  __device__ __forceinline__ Interval visible_columns(int r, const route::RouteParams& p,
                                                      const route::SeqInfo& si) const {
    const auto [q, takes, partial] = row(r, si);
    const int diag = q + si.diag_offset - k0;
    int limit = takes ? n_valid - 1 : -1, lo = 0, hi = limit, sink_hi = -1;
    if (partial) {
      if (p.causal) limit = min(limit, diag);
      // Written so that no sum overflows for windows up to INT_MAX.
      hi = p.window_right >= 0 && p.window_right < limit - diag ? diag + p.window_right : limit;
      if (p.window_left >= 0 && diag > p.window_left) lo = diag - p.window_left;
      sink_hi = min(limit, p.sink_tokens - k0 - 1);
    }
    return {lo, hi, sink_hi};
  }

  template <bool kPairColumns, int kSplit, class TS, class TC>
  __device__ __forceinline__ static void apply_positional(const RouteMask& left, const RouteMask& right, TS& s,
                                                          const TC& c, const route::RouteParams& p,
                                                          const route::SeqInfo& si) {
    constexpr int kCols = decltype(size<1>(s))::value;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const int r = get<0>(c(i, 0));
      const Interval in[2] = {left.visible_columns(r, p, si),
                              kSplit < kCols ? right.visible_columns(r, p, si) : Interval{}};
      if constexpr (kPairColumns) {
        // A thread's columns in a row, base + {0, 1, 8, 9, 16, 17, ...}, are counted left of a
        // bound, so that each interval becomes a run of element bits: a few integer operations
        // per row, then one bit test per element (R2P and a select) instead of four compares.
        const int base = get<1>(c(i, 0));
        const auto elements_before = [&](int col) {
          const int d = min(max(col - base, 0), 4 * kCols);
          return 2 * (d >> 3) + min(d & 7, 2);
        };
        const auto keep_word = [&](const Interval& v, int w) {
          const int from = elements_before(v.lo), to = elements_before(v.hi + 1),
                    sink_to = elements_before(v.sink_hi + 1);
          return (low_bits(to - 32 * w) & ~low_bits(from - 32 * w)) | low_bits(sink_to - 32 * w);
        };
        CUTE_UNROLL
        for (int w = 0; w < (kCols + 31) / 32; ++w) {
          unsigned keep = keep_word(in[0], w);
          if constexpr (kSplit < kCols) {
            static_assert(kSplit % 32 == 0 || kCols <= 32, "the split falls inside one word");
            const unsigned left_bits = low_bits(kSplit - 32 * w);
            keep = (keep & left_bits) | (keep_word(in[1], w) & ~left_bits);
          }
          CUTE_UNROLL
          for (int j = 32 * w; j < min(kCols, 32 * w + 32); ++j)
            if (!(keep & (1u << (j - 32 * w)))) s(i, j) = -INFINITY;
        }
      } else {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const Interval& v = in[j < kSplit ? 0 : 1];
          const int col = get<1>(c(i, j));
          if (!((col >= v.lo && col <= v.hi) || col <= v.sink_hi)) s(i, j) = -INFINITY;
        }
      }
    }
  }

  // The n lowest bits set (n <= 0: none, n >= 32: all).
  __device__ __forceinline__ static unsigned low_bits(int n) { return __funnelshift_lc(~0u, 0u, max(n, 0)); }
};

}  // namespace bsattn::gpu::fwd
