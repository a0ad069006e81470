// The GPU backward pass as plan.cpp sees it: its workspace (sized and allocated at plan time)
// and the launch sequence on the caller's stream (no host sync, no allocation).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "bsattn/backward_params.hpp"

namespace bsattn::gpu {

// One entry of the column-major route stream (SPEC §9): a Q tile that attends this column's KV
// tile. Column c = (b * Hs + hs) * max_kv_tiles + kv_tile holds its entries by ascending q_tile.
struct ColumnRoute {
  std::int32_t q_tile;
  std::int32_t position;  // index of the route in its row (the deterministic dQ order)
  std::uint8_t rows, masked;  // the row route's unit bits
  std::uint8_t reserved[2];
};
static_assert(sizeof(ColumnRoute) == 12, "column records are 12 bytes");

// Sizes of everything the backward keeps besides the forward's route workspace.
struct BackwardGeometry {
  std::int64_t q_rows = 0;  // token rows of Q: B * Sq batched, total_q varlen
  int heads_q = 0, head_dim = 0;
  std::int64_t columns = 0;  // B * Hs * max_kv_tiles
  std::int64_t ctas = 0;  // the main kernel's CTAs: B * Hkv * max_kv_tiles
  int column_capacity = 0;  // max_q_tiles
  std::int64_t semaphores = 0;  // B * Hq * max_q_tiles (deterministic dQ order)
  // 64-row tiles per query head of the tiled dQ accumulator (bwd/dq_tiles.hpp), 0 for the
  // row-major one [q_rows][Hq][D].
  std::int64_t dq_tiles = 0;

  std::int64_t dq_accum_floats() const {
    return (dq_tiles > 0 ? dq_tiles * 64 : q_rows) * heads_q * head_dim;
  }
};

// Device storage carved from one allocation: dQ accumulator (f32, tiled or [q_rows][Hq][D]), LSE * log2(e)
// and delta [Hq][q_rows] f32, dQ order semaphores, column counts and records, the CTA order.
struct BackwardWorkspace {
  float* dq_accum = nullptr;
  float* lse_log2 = nullptr;
  float* delta = nullptr;
  std::int32_t* semaphores = nullptr;
  std::int32_t* column_counts = nullptr;
  ColumnRoute* columns = nullptr;
  std::int32_t* cta_order = nullptr;  // [ctas]: the CTA each block runs, longest walks first
  BackwardGeometry geometry;

  static std::size_t bytes(const BackwardGeometry& g);
  // Points the fields into `base` (bytes(g) bytes of device memory).
  void carve(void* base, const BackwardGeometry& g);
};

// KV tile width of the backward kernel that serves a route tile_n, or 0 if this build has none
// for (dtype, head_dim, tile_n).
int backward_kernel_block_n(ElementType dtype, int head_dim, int tile_n);

// Raises the shared-memory limit of the kernels serving this shape (plan time, not a stream op).
cudaError_t configure_backward(ElementType dtype, int head_dim, int tile_n);

// Preprocessing (delta, LSE in log2 units, zeroed dQ accumulator and semaphores), the column
// stream from the prepared row-major routes, the main kernel (dK, dV; dQ accumulated in fp32),
// and the dQ conversion, all on `stream`. `overflow` is route preparation's flag: when set,
// nothing is written. deterministic: dQ contributions are added in route order (bit-identical
// repeats) instead of in whatever order the CTAs reach them.
cudaError_t run_backward(const BackwardParams& g, const BackwardWorkspace& ws, const int* overflow,
                         bool deterministic, cudaStream_t stream);

}  // namespace bsattn::gpu
