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
// of O and dO). LSE and dLSE are read first: read after the sum, they were a second round trip
// per thread (Nsight Compute: 128 -> 118 us at S 16384, Hq 32; 2, 4 items per lane group:
// 128, 165 us).
// The kernel also zeroes the dQ accumulator (`dq_chunks` 16-byte chunks), as FlashAttention-3's
// preprocessing does: its stores issue ahead of the rows' loads, where a memset was a pass of
// its own before this kernel.
__global__ void __launch_bounds__(32 * kRowWarps)
    preprocess_kernel(const BackwardParams g, std::int64_t q_rows, float* lse_log2, float* delta, float4* dq_accum,
                      std::int64_t dq_chunks) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < dq_chunks; c += stride)
    dq_accum[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const AttentionParams& a = g.fwd;
  const int lanes = preprocess_lanes(a.head_dim), lane = threadIdx.x % lanes;
  const std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / lanes;
  const int heads = a.route.heads_q;
  const bool in = item < q_rows * heads;  // out-of-range lanes still take part in the shuffles
  const int h = in ? static_cast<int>(item % heads) : 0;
  const std::int64_t row = in ? item / heads : 0;
  const PackedRow r = packed_row(a.route, row);
  const float lse = in && lane == 0 ? a.lse[a.lse_offset(r.b, r.si, r.q, h)] : 0.0f;
  const float dlse = in && lane == 0 && g.dlse ? g.dlse[g.dlse_offset(r.b, r.si, r.q, h)] : 0.0f;
  float sum = 0.0f;
  if (in) {
    const std::int64_t o = a.out_offset(r.b, r.si, r.q, h), d_o = g.q_like_offset(g.dout_strides, r.b, r.si, r.q, h);
    if (a.head_dim % 8 == 0 && a.out_type != ElementType::f32 && vector_aligned(a.out, o, a.out_type) &&
        vector_aligned(g.dout, d_o, a.out_type)) {
      for (int i = 8 * lane; i < a.head_dim; i += 8 * lanes)
        sum += dot8(*reinterpret_cast<const uint4*>(static_cast<const char*>(a.out) + 2 * (o + i)),
                    *reinterpret_cast<const uint4*>(static_cast<const char*>(g.dout) + 2 * (d_o + i)), a.out_type);
    } else {
      for (int i = lane; i < a.head_dim; i += lanes)
        sum += load_element(a.out, o + i, a.out_type) * load_element(g.dout, d_o + i, a.out_type);
    }
  }
  for (int m = lanes / 2; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (in && lane == 0) {
    delta[h * q_rows + row] = sum - dlse;
    lse_log2[h * q_rows + row] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
}

// dq = scale * accumulator, rounded once into dq's dtype and layout.
// Tiled accumulator (tiles_per_head > 0): a thread takes 8 columns of rows r and r + 8 of a 64-row
// tile, whose values share the accumulator's 16-byte fragment slots: four 16-byte loads of 64
// contiguous bytes, two stores of 8 elements (reading one row's 8 values took four 8-byte loads
// from half-used slots). Row-major accumulator: 8 elements of one (row, head) per thread.
__global__ void convert_dq_kernel(const BackwardParams g, std::int64_t q_rows, std::int64_t tiles_per_head,
                                  const float* dq_accum, const int* overflow) {
  if (*overflow != 0) return;
  const AttentionParams& a = g.fwd;
  const int d = a.head_dim, heads = a.route.heads_q, col_chunks = d / 8;
  const auto store8 = [&](std::int64_t row, int h, int col, float x[8]) {  // packed token row
    const PackedRow r = packed_row(a.route, row);
    const std::int64_t dst = g.q_like_offset(g.dq_strides, r.b, r.si, r.q, h) + col;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= a.scale;
    if (vector_aligned(g.dq, dst, g.dq_type)) {
      store_elements8(g.dq, dst, g.dq_type, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) store_element(g.dq, dst + i, g.dq_type, x[i]);
    }
  };
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (tiles_per_head > 0) {
    const std::int64_t chunks = heads * tiles_per_head * 32 * col_chunks;
    for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
      const int k = static_cast<int>(c % col_chunks), pair = static_cast<int>(c / col_chunks % 32);
      const std::int64_t tile = c / col_chunks / 32;  // h * tiles_per_head + the tile of head h
      const int h = static_cast<int>(tile / tiles_per_head);
      const int r0 = (pair / 8) * 16 + pair % 8, col = 8 * k;
      const std::int64_t padded = (tile % tiles_per_head) * 64 + r0;
      int b0, q0, b1, q1;
      dq_padded_row(a.route, padded, b0, q0);
      dq_padded_row(a.route, padded + 8, b1, q1);
      if (q0 < 0 && q1 < 0) continue;
      const float4* slot = reinterpret_cast<const float4*>(
          dq_accum + dq_tile_offset(tiles_per_head, h, tile % tiles_per_head, d) + dq_row_pair_slots(r0, col, d));
      float x0[8], x1[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = slot[i];
        x0[2 * i] = v.x, x0[2 * i + 1] = v.y, x1[2 * i] = v.z, x1[2 * i + 1] = v.w;
      }
      if (q0 >= 0) store8(route::seq_info(a.route, b0).q_base + q0, h, col, x0);
      if (q1 >= 0) store8(route::seq_info(a.route, b1).q_base + q1, h, col, x1);
    }
    return;
  }
  const std::int64_t chunks = q_rows * heads * col_chunks;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    const std::int64_t rh = c / col_chunks;  // row * heads + h
    const int col = static_cast<int>(c % col_chunks) * 8, h = static_cast<int>(rh % heads);
    float x[8];
    load_elements8(dq_accum, rh * d + col, ElementType::f32, x);
    store8(rh / heads, h, col, x);
  }
}

}  // namespace bsattn::gpu::bwd
