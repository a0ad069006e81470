// Route preparation on the GPU: the same row preparation as the CPU engine (route/prepare.hpp), a
// warp per route row, or a block of warps per row for a few long rows (a decode step); no host
// synchronisation.
// Overflow raises a device-side flag the plan reports later.
#pragma once
#include <cuda_runtime.h>

#include "bsattn/attention_params.hpp"

namespace bsattn::gpu {

// The plan's device flags (int[kRouteFlagWords], zero when allocated): [0, 1] the overflow flag
// {row + 1, records needed} of an overflowing row, else {0, 0}, written by every prepare_routes
// launch; [2] the forward kernel's work counter; [3, 4] and [5] prepare_routes' pending overflow
// and finished blocks. Each launch leaves [2..5] zero again (the last route block publishes [0, 1]
// from [3, 4]; the forward kernel's last claim resets [2]), so a run needs no memset before it
// (a launch and a stream dependency less per run: issue 14's host time). [6]: the device value
// checks' verdict (gpu/check_values.hpp), written only by runs with validate = true. [7]: how many
// rows of the work order lie in their sequences (order_rows), for the forward kernel.
constexpr int kRouteFlagWords = 8;
constexpr int kValuesInvalidWord = 6;
constexpr int kLiveRowsWord = 7;

// Fills params.routes / params.route_counts (device pointers) for every route row and writes the
// overflow flag: `overflow` points at the kRouteFlagWords flags.
// `proxy_counts` ([rows], device, or null): the proxy records at the end of each row, for the
// proxy kernels (AttentionParams::route_proxy_counts).
cudaError_t prepare_routes(const AttentionParams& params, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream, std::int32_t* proxy_counts = nullptr);

// The work order of the persistent attention kernel (work_order.cuh, which the backward's CTA
// order shares with its own groups): route rows grouped by the K/V they read
// (`rows_per_group` consecutive rows: one (b, KV head), or one (b, sparsity head) where a
// sparsity head spans several KV heads), longest first inside a group. `max_count`: the most
// routes a row can have (the plan's capacity).
struct RowOrder {
  int rows_per_group = 1;
  int max_count = 1;
};
// The sort's bins: at most kOrderGroups bin ranges of groups (more groups share one, consecutive
// groups together), each of kOrderBins / ranges bins of route counts scaled by max_count.
constexpr int kOrderBins = 2048;
constexpr int kOrderGroups = 16;
// Count bins per group range; the last bin of all holds the items with nothing to do.
BSATTN_HD constexpr int order_count_bins(int group_ranges) { return (kOrderBins - 1) / group_ranges; }
RowOrder row_order_groups(const route::RouteParams& route);

// Writes the route rows into `order` ([rows], device) in that order. With `route` (else every
// row counts as live), the rows whose Q tile starts past their sequence's end (varlen: the rows a
// short sequence leaves empty up to max_q_tiles) go last, and `live_rows` (device, if not null)
// receives how many rows precede them.
cudaError_t order_rows(const std::int32_t* counts, int rows, RowOrder groups, std::int32_t* order,
                       cudaStream_t stream, const route::RouteParams* route = nullptr,
                       std::int32_t* live_rows = nullptr);

// Derives cu_total_m_blocks and cu_block_idx_offsets ([B+1] each, device) from the sequence
// lengths in `route` (SPEC §3.2) without a host sync.
cudaError_t derive_varlen_block_offsets(const route::RouteParams& route, std::int32_t* cu_total_m_blocks,
                                        std::int32_t* cu_block_idx_offsets, cudaStream_t stream);

}  // namespace bsattn::gpu
