// The counting sort behind the work orders of the GPU kernels: the persistent forward's route
// rows (prepare_routes.cu) and the backward's CTAs (backward.cu). Items are binned by group
// (RowOrder::rows_per_group consecutive items: the work that reads one KV head's tensors), then by
// their work, longest first. A group's items then run at the same time and find what they share in
// L2, and each group still ends with its shortest items, so that the last group's fill the tail
// (longest-processing-time-first within the group). The order inside a bin is whatever the
// atomics give, which changes the schedule but never a result.
#pragma once
#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "gpu/prepare_routes.hpp"

namespace bsattn::gpu {

constexpr int kOrderThreads = kOrderBins / 2;  // two bins per thread in the scan

// One block; `work(i)` (the same value on every call) is item i's work, in [0, groups.max_count];
// `work.live(i)`: whether item i has anything to do at all. Items that do not (a route row past
// its sequence's end) go after every group, and `live_items` (if not null) receives how many
// come before them: the kernel then never visits the rest.
template <class Work>
__global__ void __launch_bounds__(kOrderThreads)
    order_by_work_kernel(const Work work, int items, RowOrder groups, std::int32_t* order, std::int32_t* live_items) {
  using Scan = cub::BlockScan<int, kOrderThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int start[kOrderBins];  // histogram, then the first position of each bin
  const int group_count = (items + groups.rows_per_group - 1) / groups.rows_per_group;
  const int group_bins = min(group_count, kOrderGroups);
  const int count_bins = order_count_bins(group_bins);
  const auto bin = [&](int i) {
    if (!work.live(i)) return kOrderBins - 1;
    const int group = static_cast<int>(static_cast<long long>(i / groups.rows_per_group) * group_bins / group_count);
    const int level = min(static_cast<int>(static_cast<long long>(work(i)) * count_bins / (groups.max_count + 1)),
                          count_bins - 1);
    return group * count_bins + count_bins - 1 - level;  // longest first
  };
  for (int i = threadIdx.x; i < kOrderBins; i += kOrderThreads) start[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < items; i += kOrderThreads) atomicAdd(&start[bin(i)], 1);
  __syncthreads();
  int pair[2] = {start[2 * threadIdx.x], start[2 * threadIdx.x + 1]};
  Scan(scan).ExclusiveSum(pair, pair);
  __syncthreads();
  start[2 * threadIdx.x] = pair[0];
  start[2 * threadIdx.x + 1] = pair[1];
  if (live_items && threadIdx.x == kOrderThreads - 1) *live_items = pair[1];  // where the last bin starts
  __syncthreads();
  for (int i = threadIdx.x; i < items; i += kOrderThreads) order[atomicAdd(&start[bin(i)], 1)] = i;
}

}  // namespace bsattn::gpu
