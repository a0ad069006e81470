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
  template <bool kTokenTensors, class TS, class TC>
  __device__ __forceinline__ void apply(TS& s, const TC& c, const AttentionParams& a, const route::SeqInfo& si,
                                        int b) const {
    if constexpr (!kTokenTensors) {
      apply_positional(s, c, a.route, si);
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

  // Causal, window and sinks only (no per-token tensors): the visible KV range of a row follows
  // from its diagonal, so each element costs a few integer compares. Same predicate as
  // route::token_visible: (kv <= diag if causal) && (diag - wl <= kv <= diag + wr || kv < sinks).
  template <class TS, class TC>
  __device__ __forceinline__ void apply_positional(TS& s, const TC& c, const route::RouteParams& p,
                                                   const route::SeqInfo& si) const {
    constexpr int kBig = 0x3fffffff;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const auto [q, takes, partial] = row(get<0>(c(i, 0)), si);
      // Column bounds relative to k0: visible iff col < n_valid and
      // (col <= causal_hi) and ((lo <= col <= win_hi) or col < sink).
      const int diag = q + si.diag_offset - k0;
      int causal_hi = kBig, lo = -kBig, win_hi = kBig, sink = -kBig;
      if (partial) {
        if (p.causal) causal_hi = diag;
        if (p.window_left >= 0) lo = diag - p.window_left;
        if (p.window_right >= 0) win_hi = diag + p.window_right;
        sink = p.sink_tokens - k0;
      }
      const int limit = takes ? min(n_valid - 1, causal_hi) : -1;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        const int col = get<1>(c(i, j));
        const bool visible = col <= limit && ((col >= lo && col <= win_hi) || col < sink);
        if (!visible) s(i, j) = -INFINITY;
      }
    }
  }
};

}  // namespace bsattn::gpu::fwd
