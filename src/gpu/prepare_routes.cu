#include "gpu/prepare_routes.hpp"

#include <cub/block/block_scan.cuh>

#include "bsattn/route/prepare.hpp"

namespace bsattn::gpu {
namespace {

__global__ void prepare_routes_kernel(const route::RouteParams p, int rows, route::Route* routes,
                                      std::int32_t* counts, std::int32_t* proxy_counts, std::int32_t* overflow) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  route::Route* out = routes + static_cast<std::int64_t>(row) * p.capacity;
  const int needed = route::prepare_row(p, row, out);
  const int count = needed < p.capacity ? needed : p.capacity;
  counts[row] = count;
  if (proxy_counts) {  // the proxy records close the row (prepare_row emits them last)
    int proxies = 0;
    while (proxies < count && out[count - 1 - proxies].kind == static_cast<std::uint8_t>(route::RouteKind::proxy))
      ++proxies;
    proxy_counts[row] = proxies;
  }
  if (needed > p.capacity && atomicCAS(overflow, 0, row + 1) == 0) overflow[1] = needed;
}

__global__ void derive_offsets_kernel(const route::RouteParams p, std::int32_t* cu_m, std::int32_t* cu_idx) {
  route::varlen_block_offsets(p, cu_m, cu_idx);
}

// Counting sort of the route rows by route count, longest first, in one block (a few microseconds
// for thousands of rows). Counts at or above kBins share the top bin; the order inside a bin is
// whatever the atomics give, which changes the schedule but never a result.
constexpr int kOrderThreads = 1024;
constexpr int kOrderBins = 2 * kOrderThreads;

__global__ void __launch_bounds__(kOrderThreads) order_rows_kernel(const std::int32_t* counts, int rows,
                                                                   std::int32_t* order) {
  using Scan = cub::BlockScan<int, kOrderThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int start[kOrderBins];  // histogram, then the first position of each bin
  const auto bin = [](int count) { return kOrderBins - 1 - min(count, kOrderBins - 1); };  // longest first
  for (int i = threadIdx.x; i < kOrderBins; i += kOrderThreads) start[i] = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kOrderThreads) atomicAdd(&start[bin(counts[r])], 1);
  __syncthreads();
  int pair[2] = {start[2 * threadIdx.x], start[2 * threadIdx.x + 1]};
  Scan(scan).ExclusiveSum(pair, pair);
  __syncthreads();
  start[2 * threadIdx.x] = pair[0];
  start[2 * threadIdx.x + 1] = pair[1];
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kOrderThreads) order[atomicAdd(&start[bin(counts[r])], 1)] = r;
}

}  // namespace

cudaError_t order_rows_longest_first(const std::int32_t* counts, int rows, std::int32_t* order,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  order_rows_kernel<<<1, kOrderThreads, 0, stream>>>(counts, rows, order);
  return cudaGetLastError();
}

cudaError_t prepare_routes(const AttentionParams& a, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream, std::int32_t* proxy_counts) {
  if (a.route_rows == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  prepare_routes_kernel<<<(a.route_rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      a.route, a.route_rows, routes, counts, proxy_counts, overflow);
  return cudaGetLastError();
}

cudaError_t derive_varlen_block_offsets(const route::RouteParams& p, std::int32_t* cu_m, std::int32_t* cu_idx,
                                        cudaStream_t stream) {
  derive_offsets_kernel<<<1, 1, 0, stream>>>(p, cu_m, cu_idx);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
