// Per-row work of the backward around the main kernel: preprocessing (delta = rowsum(dO * O) -
// dLSE and LSE in log2 units, per query row and head, fp32) and the dQ conversion (fp32
// accumulator * scale, rounded once into dq's dtype and layout). Both address Q-like tensors by
// the packed token row: b * Sq + q batched, q_base + q varlen.
#pragma once
#include <cmath>

#include "bsattn/backward_params.hpp"
#include "gpu/bwd/dq_tiles.hpp"
#include "gpu/bwd/elements.cuh"

namespace bsattn::gpu::bwd {

// (b, sequence-local q) of packed token row `row` of a Q-like tensor; q_base 0, as the offset
// helpers add it for varlen.
struct PackedRow {
  int b, q;
  route::SeqInfo si;
};
__device__ __forceinline__ PackedRow packed_row(const route::RouteParams& p, std::int64_t row) {
  PackedRow r{};
  if (p.varlen_q) {
    r.b = 0;
    r.q = static_cast<int>(row);
  } else {
    r.b = static_cast<int>(row / p.max_seqlen_q);
    r.q = static_cast<int>(row % p.max_seqlen_q);
  }
  return r;
}

constexpr int kRowWarps = 8;

// Lanes per (row, head) of the preprocessing: each reads 8 elements of O and dO at a time, so a
// row takes D / 8 lanes, rounded down to a power of two (the shuffle reduction), at most a warp; a
// warp serves 32 / lanes rows.
BSATTN_HD constexpr int preprocess_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < 32 && 16 * lanes <= head_dim) lanes *= 2;
  return lanes;
}

// delta[h][row] = rowsum(dO * O) - dLSE, lse_log2[h][row] = LSE * log2(e), or +inf for a row that
// attended nothing (LSE = -inf), so that its P is 0. A group of preprocess_lanes(D) lanes per
// (packed row, head), 16-byte loads where O's and dO's rows allow them (bound by DRAM: one read
// of O and dO).
__global__ void __launch_bounds__(32 * kRowWarps)
    preprocess_kernel(const BackwardParams g, std::int64_t q_rows, float* lse_log2, float* delta) {
  const AttentionParams& a = g.fwd;
  const int lanes = preprocess_lanes(a.head_dim), lane = threadIdx.x % lanes;
  const std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / lanes;
  const int heads = a.route.heads_q;
  const bool in = item < q_rows * heads;  // out-of-range lanes still take part in the shuffles
  float sum = 0.0f;
  int h = 0;
  std::int64_t row = 0;
  PackedRow r{};
  if (in) {
    h = static_cast<int>(item % heads);
    row = item / heads;
    r = packed_row(a.route, row);
    const std::int64_t o = a.out_offset(r.b, r.si, r.q, h), d_o = g.q_like_offset(g.dout_strides, r.b, r.si, r.q, h);
    if (a.head_dim % 8 == 0 && vector_aligned(a.out, o, a.out_type) && vector_aligned(g.dout, d_o, a.out_type)) {
      for (int i = 8 * lane; i < a.head_dim; i += 8 * lanes) {
        float x[8], y[8];
        load_elements8(a.out, o + i, a.out_type, x);
        load_elements8(g.dout, d_o + i, a.out_type, y);
#pragma unroll
        for (int k = 0; k < 8; ++k) sum += x[k] * y[k];
      }
    } else {
      for (int i = lane; i < a.head_dim; i += lanes)
        sum += load_element(a.out, o + i, a.out_type) * load_element(g.dout, d_o + i, a.out_type);
    }
  }
  for (int m = lanes / 2; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (in && lane == 0) {
    const float lse = a.lse[a.lse_offset(r.b, r.si, r.q, h)];
    if (g.dlse) sum -= g.dlse[g.dlse_offset(r.b, r.si, r.q, h)];
    delta[h * q_rows + row] = sum;
    lse_log2[h * q_rows + row] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
}

// 8 accumulated values of (packed row, head h, columns [col, col + 8)) of the tiled accumulator
// (dq_tiles.hpp): zeros for a row past its sequence's attended rows (never added, or holding what
// the masked rows of a step gave). Varlen finds the row's sequence by binary search.
__device__ __forceinline__ void load_tiled_dq(const route::RouteParams& p, std::int64_t tiles_per_head,
                                              const float* dq_accum, std::int64_t row, int h, int col, int d,
                                              float x[8]) {
  int b = 0, q = 0;
  if (p.varlen_q) {
    int lo = 0, hi = p.batch - 1;  // the last b with cu_seqlens_q[b] <= row
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens_q[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
    q = static_cast<int>(row - p.cu_seqlens_q[b]);
  } else {
    b = static_cast<int>(row / p.max_seqlen_q);
    q = static_cast<int>(row % p.max_seqlen_q);
  }
  if (q >= route::seq_info(p, b).seqlen_q) {
    for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    return;
  }
  const std::int64_t padded = dq_padded_start(p, b) + q;
  const float* tile = dq_accum + dq_tile_offset(tiles_per_head, h, padded / 64, d);
  const int r = static_cast<int>(padded % 64);
#pragma unroll
  for (int i = 0; i < 8; i += 2) {  // column pairs are adjacent in a tile
    const float2 v = *reinterpret_cast<const float2*>(tile + dq_tile_position(r, col + i, d));
    x[i] = v.x;
    x[i + 1] = v.y;
  }
}

// dq = scale * accumulator, 8 elements of one (row, head) per thread (D % 8 == 0), from the tiled
// (tiles_per_head > 0) or the row-major accumulator.
__global__ void convert_dq_kernel(const BackwardParams g, std::int64_t q_rows, std::int64_t tiles_per_head,
                                  const float* dq_accum, const int* overflow) {
  if (*overflow != 0) return;
  const AttentionParams& a = g.fwd;
  const int d = a.head_dim, heads = a.route.heads_q;
  const std::int64_t chunks = q_rows * heads * (d / 8);
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t rh = c / (d / 8);  // row * heads + h
    const int col = static_cast<int>(c % (d / 8)) * 8, h = static_cast<int>(rh % heads);
    const PackedRow r = packed_row(a.route, rh / heads);
    const std::int64_t dst = g.q_like_offset(g.dq_strides, r.b, r.si, r.q, h) + col;
    float x[8];
    if (tiles_per_head > 0) {
      load_tiled_dq(a.route, tiles_per_head, dq_accum, rh / heads, h, col, d, x);
    } else {
      load_elements8(dq_accum, rh * d + col, ElementType::f32, x);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= a.scale;
    if (vector_aligned(g.dq, dst, g.dq_type)) {
      store_elements8(g.dq, dst, g.dq_type, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) store_element(g.dq, dst + i, g.dq_type, x[i]);
    }
  }
}

}  // namespace bsattn::gpu::bwd
