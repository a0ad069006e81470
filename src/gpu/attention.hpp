// The GPU forward pass as plan.cpp sees it: which tile shapes have a kernel in this build, and
// the launch (route stream already prepared on the same stream).
#pragma once
#include <cuda_runtime.h>

#include "bsattn/attention_params.hpp"

namespace bsattn::gpu {

// Rows of Q and of K/V along the token dimension (Sq / Skv extents batched, total_q / total_kv
// varlen, the page size paged) and the pages of a paged cache: the bounds of the kernel's bulk
// tensor copies.
struct TokenExtents {
  std::int64_t q = 0, kv = 0, kv_pages = 0;
};

// KV tile width of the kernel that serves a route tile_n (the smallest compiled width >= tile_n),
// or 0 if this build has no kernel for (dtype, head_dim, tile_m, tile_n) (with proxy compensation:
// `proxy`, SPEC §6).
int forward_kernel_block_n(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy = false);

// Raises the shared-memory limit of the kernels that serve this shape and records how many CTA
// pairs fit on the current device (plan time: not a stream operation, so run() stays capturable).
cudaError_t configure_forward(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy = false);

// Launches the forward kernel for params (device pointers; routes and counts prepared; with proxy
// routes also params.route_proxy_counts).
// `overflow` is the device flag route preparation raised; a set flag makes the kernel write nothing.
cudaError_t run_forward(const AttentionParams& params, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream);

}  // namespace bsattn::gpu
