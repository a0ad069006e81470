// Route preparation on the GPU: the same row preparation as the CPU engine (route/prepare.hpp), a
// warp per route row, or a block of warps per row for a few long rows (a decode step); no host
// synchronisation.
// Overflow raises a device-side flag the plan reports later.
#pragma once
#include <cuda_runtime.h>

#include "bsattn/attention_params.hpp"

namespace bsattn::gpu {

// Fills params.routes / params.route_counts (device pointers) for every route row. `overflow`
// (device int[2]) receives {row + 1, needed} of the first overflowing row it meets, else stays 0.
// `proxy_counts` ([rows], device, or null): the proxy records at the end of each row, for the
// proxy kernels (AttentionParams::route_proxy_counts).
cudaError_t prepare_routes(const AttentionParams& params, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream, std::int32_t* proxy_counts = nullptr);

// Writes the route rows into `order` ([rows], device) by descending route count: the work order
// of the persistent attention kernel.
cudaError_t order_rows_longest_first(const std::int32_t* counts, int rows, std::int32_t* order,
                                     cudaStream_t stream);

// Derives cu_total_m_blocks and cu_block_idx_offsets ([B+1] each, device) from the sequence
// lengths in `route` (SPEC §3.2) without a host sync.
cudaError_t derive_varlen_block_offsets(const route::RouteParams& route, std::int32_t* cu_total_m_blocks,
                                        std::int32_t* cu_block_idx_offsets, cudaStream_t stream);

}  // namespace bsattn::gpu
