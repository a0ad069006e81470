// The tiled dQ accumulator (host and device): where a step's 64 query rows start at a multiple
// of 64 in their sequence (route tile_m a multiple of 64), dQ is accumulated per (query head,
// 64-row tile) in the order of the dQ GEMM's accumulator fragments, so a thread's four
// consecutive values are 16 contiguous bytes and a warp's 32 lanes cover 512 contiguous bytes:
// each step adds with 16-byte reductions over whole lines, half the instructions and a quarter
// of the memory requests of 8-byte reductions on row-major rows (dq.cuh). The conversion kernel
// (rows.cuh) reads it back through the same mapping.
//
// A tile: kDqWarpgroups regions (the warpgroups split D), each 64 rows x N = D / kDqWarpgroups
// columns; value e of thread t of a region's warpgroup (the SM90 64 x N fp32 accumulator: warp
// t / 32 holds rows 16 (t / 32) + [0, 16), lane l rows l / 4 and l / 4 + 8, columns 8 n + 2 (l % 4)
// and + 1) sits at dq_fragment_offset(t, e / 4, N) + e % 4: each warp's values are one contiguous
// block of 16 N floats (its rows), so each warp adds its block with one bulk reduction. Tiles of a
// sequence are consecutive from its padded first row (batched: b * ceil(Sq / 64) * 64; varlen:
// (cu_seqlens[b] + 64 b) rounded down to a multiple of 64, which keeps sequences apart).
#pragma once
#include <cstdint>

#include "bsattn/route/params.hpp"

namespace bsattn::gpu::bwd {

// The dQ GEMM's warpgroups: D is split where each half fills a 64-wide swizzle atom.
BSATTN_HD constexpr int dq_warpgroups(int head_dim) { return head_dim >= 128 ? 2 : 1; }

// Tiles per query head of the tiled accumulator for a problem, or 0 where steps do not start at
// multiples of 64 (the row-major accumulator [q_rows][Hq][D] then).
inline std::int64_t dq_tiles_per_head(int tile_m, bool varlen, int batch, std::int64_t max_seqlen_q,
                                      std::int64_t total_q) {
  if (tile_m % 64 != 0) return 0;
  return varlen ? (total_q + 64 * static_cast<std::int64_t>(batch) + 63) / 64
                : static_cast<std::int64_t>(batch) * ((max_seqlen_q + 63) / 64);
}

// Padded first row of sequence b (a multiple of 64).
BSATTN_HD std::int64_t dq_padded_start(const route::RouteParams& p, int b) {
  if (p.varlen_q) return (static_cast<std::int64_t>(p.cu_seqlens_q[b]) + 64 * b) / 64 * 64;
  return static_cast<std::int64_t>(b) * ((p.max_seqlen_q + 63) / 64) * 64;
}

// Offset (floats) of tile `tile` of query head h.
BSATTN_HD std::int64_t dq_tile_offset(std::int64_t tiles_per_head, int h, std::int64_t tile, int head_dim) {
  return (h * tiles_per_head + tile) * 64 * head_dim;
}

// Offset (floats) within a region of thread t's values 4 j .. 4 j + 3 (N columns per region): the
// warp's block, then for each j the warp's 32 lanes, 16 bytes each (a warp's 16-byte stores of one
// j cover 512 contiguous bytes: no bank conflicts).
BSATTN_HD constexpr int dq_fragment_offset(int t, int j, int n) { return (t / 32) * 16 * n + (j * 32 + t % 32) * 4; }

// Offset within a tile of (row, column).
BSATTN_HD int dq_tile_position(int row, int col, int head_dim) {
  const int n = head_dim / dq_warpgroups(head_dim);  // columns per region
  const int region = col / n, c = col % n;
  const int t = (row / 16) * 32 + (row % 8) * 4 + (c % 8) / 2;
  const int e = (c % 2) + 2 * ((row % 16) / 8) + 4 * (c / 8);
  return region * 64 * n + dq_fragment_offset(t, e / 4, n) + e % 4;
}

// Offset within a tile of the four 16-byte slots that hold columns [col, col + 8) (col a multiple
// of 8) of rows r0 and r0 + 8 (r0 % 16 < 8): slot i is (r0, col + 2 i), (r0, col + 2 i + 1),
// (r0 + 8, col + 2 i), (r0 + 8, col + 2 i + 1) — the values of fragment thread t0 + i.
BSATTN_HD int dq_row_pair_slots(int r0, int col, int head_dim) {
  const int n = head_dim / dq_warpgroups(head_dim);
  const int t0 = (r0 / 16) * 32 + (r0 % 8) * 4;
  return (col / n) * 64 * n + dq_fragment_offset(t0, (col % n) / 8, n);
}

// The sequence b and its row q of padded row `padded` of the accumulator, or q = -1 for a row of a
// sequence's padding. Varlen: a binary search over the padded starts (they ascend by >= 64).
BSATTN_HD void dq_padded_row(const route::RouteParams& p, std::int64_t padded, int& b, int& q) {
  if (p.varlen_q) {
    int lo = 0, hi = p.batch - 1;  // the last b whose padded start is <= padded
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (dq_padded_start(p, mid) <= padded) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
  } else {
    b = static_cast<int>(padded / ((p.max_seqlen_q + 63) / 64 * 64));  // max_seqlen_q >= 1
  }
  const std::int64_t local = padded - dq_padded_start(p, b);
  q = local < route::seq_info(p, b).seqlen_q ? static_cast<int>(local) : -1;
}

}  // namespace bsattn::gpu::bwd
