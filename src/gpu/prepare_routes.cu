#include "gpu/prepare_routes.hpp"

#include "bsattn/route/prepare.hpp"

namespace bsattn::gpu {
namespace {

__global__ void prepare_routes_kernel(const route::RouteParams p, int rows, route::Route* routes,
                                      std::int32_t* counts, std::int32_t* overflow) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const int needed = route::prepare_row(p, row, routes + static_cast<std::int64_t>(row) * p.capacity);
  counts[row] = needed < p.capacity ? needed : p.capacity;
  if (needed > p.capacity && atomicCAS(overflow, 0, row + 1) == 0) overflow[1] = needed;
}

__global__ void derive_offsets_kernel(const route::RouteParams p, std::int32_t* cu_m, std::int32_t* cu_idx) {
  route::varlen_block_offsets(p, cu_m, cu_idx);
}

}  // namespace

cudaError_t prepare_routes(const AttentionParams& a, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream) {
  if (a.route_rows == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  prepare_routes_kernel<<<(a.route_rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(a.route, a.route_rows,
                                                                                          routes, counts, overflow);
  return cudaGetLastError();
}

cudaError_t derive_varlen_block_offsets(const route::RouteParams& p, std::int32_t* cu_m, std::int32_t* cu_idx,
                                        cudaStream_t stream) {
  derive_offsets_kernel<<<1, 1, 0, stream>>>(p, cu_m, cu_idx);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
