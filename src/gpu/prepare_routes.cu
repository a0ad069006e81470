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

// One thread: B is small next to everything else, and a serial scan needs no second pass.
__global__ void derive_offsets_kernel(const route::RouteParams p, std::int32_t* cu_m, std::int32_t* cu_idx) {
  route::RouteParams q = p;
  q.cu_total_m_blocks = nullptr;
  q.cu_block_idx_offsets = nullptr;
  std::int32_t m = 0, idx = 0;
  cu_m[0] = 0;
  cu_idx[0] = 0;
  for (int b = 0; b < q.batch; ++b) {
    const route::SeqInfo s = route::seq_info(q, b);
    m += s.q_blocks;
    idx += s.q_blocks * s.kv_blocks;
    cu_m[b + 1] = m;
    cu_idx[b + 1] = idx;
  }
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
