// The GPU forward pass as plan.cpp sees it: which tile shapes have a kernel in this build, and
// the launch (route stream already prepared on the same stream).
#pragma once
#include <cuda_runtime.h>

#include "api/merge_params.hpp"
#include "bsattn/attention_params.hpp"

namespace bsattn::gpu {

// Rows of Q and of K/V along the token dimension (Sq / Skv extents batched, total_q / total_kv
// varlen, the page size paged) and the pages of a paged cache: the bounds of the kernel's bulk
// tensor copies.
struct TokenExtents {
  std::int64_t q = 0, kv = 0, kv_pages = 0;
};

// The decode kernel's shape (fwd/decode.cuh), chosen at plan time: a tile's 64 rows are
// `packed_heads` query heads of one KV group (a power of two) times 64 / packed_heads tokens (the
// route tile_m), and each (route row, head group) is cut into `kv_splits` work items over its
// routes. With splits, the kernel writes fp32 partial O and LSE where the params' O and LSE point
// (laid out as the outputs, split after split, `out_split_step` / `lse_split_step` elements
// apart), and the last split of each (route row, head group) to finish merges them into `result`
// (of `result_type`), counting arrivals in `split_arrivals` (one int per (route row, head group),
// zero before the launch and left zero after it).
struct DecodeShape {
  int packed_heads = 1;
  int kv_splits = 1;
  std::int64_t out_split_step = 0, lse_split_step = 0;
  merge::Layout result;
  ElementType result_type = ElementType::bf16;
  std::int32_t* split_arrivals = nullptr;
};

// KV tile width of the kernel that serves a route tile_n (the smallest compiled width >= tile_n),
// or 0 if this build has no kernel for (dtype, head_dim, tile_m, tile_n) (with proxy compensation:
// `proxy`, SPEC §6; the decode kernel: `decode`, tile_m 16, 32 or 64).
int forward_kernel_block_n(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy = false,
                           bool decode = false);

// The route width for exact prefill tiles of `geometry` (its tile_m, tile_n and heads) on the GPU:
// 64 where tile_m is 64, the query heads cannot be packed two per tile, and the 64-wide kernel
// fits more CTAs per multiprocessor than the one of tile_n (a tile of one query head has one
// consumer warpgroup, whose softmax then runs under the other CTA's GEMMs); else tile_n.
int prefill_route_tile_n(ElementType dtype, int head_dim, const route::RouteParams& geometry);

// The route width for split-KV decode tiles: 64 where the 64-wide decode kernel fits more CTAs per
// multiprocessor than the one serving tile_n (two: a split step's cluster of up to 16 CTAs then
// fits on 8 multiprocessors, so the splits merge through distributed shared memory); else tile_n.
int decode_route_tile_n(ElementType dtype, int head_dim, int tile_n);

// Raises the shared-memory limit of the kernels that serve this shape and records how many CTA
// pairs fit on the current device (plan time: not a stream operation, so run() stays capturable).
cudaError_t configure_forward(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy = false,
                              bool decode = false);

// Launches the forward kernel for params (device pointers; routes and counts prepared; with proxy
// routes also params.route_proxy_counts); `decode`: the decode kernel of that shape (with splits it
// writes the partial results only: the caller merges them).
// `overflow` is the device flag route preparation raised; a set flag makes the kernel write nothing.
cudaError_t run_forward(const AttentionParams& params, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream, const DecodeShape* decode = nullptr);

}  // namespace bsattn::gpu
