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

  // s: scores (rowcol view); c: their (row, col) coordinates in the 64 x N tile (same view).
  template <class TS, class TC>
  __device__ __forceinline__ void apply(TS& s, const TC& c, const AttentionParams& a, const route::SeqInfo& si,
                                        int b) const {
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const int r = get<0>(c(i, 0));
      const int q = q_begin + r;
      const int unit = (tile_row0 + r) / unit_m;
      const bool takes = ((rows >> unit) & 1u) && q < si.seqlen_q;
      const bool partial = (masked >> unit) & 1u;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        const int col = get<1>(c(i, j));
        bool visible = takes && col < n_valid;
        if (visible && partial) visible = route::token_visible(a.route, si, b, q, k0 + col);
        if (!visible) s(i, j) = -INFINITY;
      }
    }
  }
};

}  // namespace bsattn::gpu::fwd
