// Masking of one route's score tile. Full routes (every present unit takes the route unmasked,
// the tile lies inside the sequence) run none of this; otherwise each element checks its unit's
// route bits, the sequence tails and, for partial units, the built-in token mask. The mask's
// values (causal, window, sinks, documents, KV validity) are runtime parameters: one
// instantiation serves every built-in mask.
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/mask.hpp"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

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
  // kTokenTensors: the problem has document ids or KV validity bits, evaluated per element by
  // route::token_visible; without them the positional path below runs. A kernel policy, not a
  // run-time branch: compiled into one kernel, the per-element tensor path raised the register
  // pressure of the whole main loop (spills everywhere, 15 KB in the 64-wide kernels).
  // kPairColumns: the view's column j lies at c(i, 0) + 8 (j / 2) + j % 2, as the columns of a
  // wgmma accumulator do (the forward's S tile); the positional path then masks a row by bits.
  template <bool kTokenTensors, bool kPairColumns = false, class TS, class TC>
  __device__ __forceinline__ void apply(TS& s, const TC& c, const AttentionParams& a, const route::SeqInfo& si,
                                        int b) const {
    if constexpr (!kTokenTensors) {
      apply_positional<kPairColumns>(s, c, a.route, si);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const auto [q, takes, partial] = row(get<0>(c(i, 0)), si);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          const int col = get<1>(c(i, j));
          bool visible = takes && col < n_valid;
          if (visible && partial) visible = route::token_visible(a.route, si, b, q, k0 + col);
          if (!visible) s(i, j) = -INFINITY;
        }
      }
    }
  }

  // Causal, window and sinks only (no per-token tensors): the visible KV columns of a row (relative
  // to k0) follow from its diagonal as two intervals, [lo, hi] (the causal limit, the window and
  // the tile's valid columns) and [0, sink_hi] (the sinks, under the same causal and valid limits).
  // Same predicate as route::token_visible: (kv <= diag if causal) && (diag - wl <= kv <= diag + wr
  // || kv < sinks).
  template <bool kPairColumns, class TS, class TC>
  __device__ __forceinline__ void apply_positional(TS& s, const TC& c, const route::RouteParams& p,
                                                   const route::SeqInfo& si) const {
    constexpr int kCols = decltype(size<1>(s))::value;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const auto [q, takes, partial] = row(get<0>(c(i, 0)), si);
      const int diag = q + si.diag_offset - k0;
      int limit = takes ? n_valid - 1 : -1, lo = 0, hi = limit, sink_hi = -1;
      if (partial) {
        if (p.causal) limit = min(limit, diag);
        // Written so that no sum overflows for windows up to INT_MAX.
        hi = p.window_right >= 0 && p.window_right < limit - diag ? diag + p.window_right : limit;
        if (p.window_left >= 0 && diag > p.window_left) lo = diag - p.window_left;
        sink_hi = min(limit, p.sink_tokens - k0 - 1);
      }
      if constexpr (kPairColumns) {
        // A thread's columns in a row, base + {0, 1, 8, 9, 16, 17, ...}, are counted left of a
        // bound, so that each interval becomes a run of element bits: a few integer operations
        // per row, then one bit test per element (R2P and a select) instead of four compares.
        const int base = get<1>(c(i, 0));
        const auto elements_before = [&](int col) {
          const int d = min(max(col - base, 0), 4 * kCols);
          return 2 * (d >> 3) + min(d & 7, 2);
        };
        const int from = elements_before(lo), to = elements_before(hi + 1), sink_to = elements_before(sink_hi + 1);
        CUTE_UNROLL
        for (int w = 0; w < (kCols + 31) / 32; ++w) {
          const unsigned keep = (low_bits(to - 32 * w) & ~low_bits(from - 32 * w)) | low_bits(sink_to - 32 * w);
          CUTE_UNROLL
          for (int j = 32 * w; j < min(kCols, 32 * w + 32); ++j)
            if (!(keep & (1u << (j - 32 * w)))) s(i, j) = -INFINITY;
        }
      } else {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const int col = get<1>(c(i, j));
          if (!((col >= lo && col <= hi) || col <= sink_hi)) s(i, j) = -INFINITY;
        }
      }
    }
  }

  // The n lowest bits set (n <= 0: none, n >= 32: all).
  __device__ __forceinline__ static unsigned low_bits(int n) { return __funnelshift_lc(~0u, 0u, max(n, 0)); }
};

}  // namespace bsattn::gpu::fwd
