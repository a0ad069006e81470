#include "gpu/prepare_routes.hpp"

#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "bsattn/route/prepare.hpp"

// tests/gpu/emulation runs the kernels' logic on the host.
#if defined(BSATTN_GPU_HOST_EMULATION)
#define BSATTN_LAUNCH(kernel, blocks, threads, stream, ...) emulate_launch(kernel, dim3(blocks), threads, 0, __VA_ARGS__)
#else
#define BSATTN_LAUNCH(kernel, blocks, threads, stream, ...) kernel<<<blocks, threads, 0, stream>>>(__VA_ARGS__)
#endif

namespace bsattn::gpu {
namespace {

// Sum of v over the lanes below this one; *total: over the warp.
__device__ __forceinline__ int warp_exclusive_sum(int v, int lane, int* total) {
  int x = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  *total = __shfl_sync(0xffffffffu, x, 31);
  return x - v;
}

// A warp per row, lane i classifying block c0 + i of each 32-block chunk (prepare_row's steps,
// records placed by warp prefix sums in prepare_row's order); kProxy: then the row's proxy
// records. A thread per row walked every KV block of the row serially: nKB x rows steps with
// proxy routes (512 x 20480 at S = 32768 and blocks of 64), and for the few long rows of a decode
// step (one row of 1024 blocks at L = 131072) ~0.7 ms of one thread before the kernel could start.
// The lanes advance identical cursors (the same loads, broadcast).
constexpr int kRowThreads = 128;

template <int kUnits, bool kProxy>
__global__ void __launch_bounds__(kRowThreads)
    prepare_routes_kernel(const route::RouteParams p, int rows, route::Route* routes, std::int32_t* counts,
                          std::int32_t* proxy_counts, std::int32_t* overflow) {
  const int row = blockIdx.x * (kRowThreads / 32) + static_cast<int>(threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  route::Route* out = routes + static_cast<std::int64_t>(row) * p.capacity;
  route::RowState<kUnits> r;
  int count = 0, exact = 0;
  if (route::open_row(p, row, r)) {
    route::ChunkWords<kUnits> w;
    for (int c0 = 0; c0 < r.s.kv_blocks; c0 += 32) {
      route::take_chunk(p, r, c0, w);
      if (!w.selected) continue;
      const bool selected = (w.selected >> lane) & 1u;
      int n = 0;  // this lane's records: counted, then written after the lanes below it
      if (selected) route::exact_routes(p, r, w, c0, lane, [&](int, unsigned, unsigned) { ++n; });
      int total;
      int at = count + warp_exclusive_sum(n, lane, &total);
      if (selected)
        route::exact_routes(p, r, w, c0, lane, [&](int index, unsigned units, unsigned masked) {
          route::put_route(out, p.capacity, at++, index, route::RouteKind::exact, units, masked);
        });
      count += total;
    }
    exact = count;
    if constexpr (kProxy) {
      route::open_cursors(p, r);
      for (int c0 = 0; c0 < r.s.kv_blocks; c0 += 32) {
        route::take_chunk(p, r, c0, w);
        const unsigned units =
            c0 + lane < r.s.kv_blocks ? route::proxy_units(p, r, w, c0, lane, route::NoCustomMask()) : 0u;
        const unsigned ballot = __ballot_sync(0xffffffffu, units != 0);
        if (units)
          route::put_route(out, p.capacity, count + __popc(ballot & ((1u << lane) - 1u)), c0 + lane,
                           route::RouteKind::proxy, units, 0);
        count += __popc(ballot);
      }
    }
  }
  if (lane != 0) return;
  const int stored = count < p.capacity ? count : p.capacity;
  counts[row] = stored;
  if (proxy_counts) proxy_counts[row] = stored - (exact < p.capacity ? exact : p.capacity);  // the row's last records
  if (count > p.capacity && atomicCAS(overflow, 0, row + 1) == 0) overflow[1] = count;
}

// f(std::integral_constant<int, kUnits>) with kUnits >= tile_m / unit_m (1, 2, 4 or 8).
template <class F>
cudaError_t with_units(const route::RouteParams& p, const F& f) {
  switch (p.tile_m / p.unit_m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, route::kMaxUnitsPerTile>{});
  }
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
  BSATTN_LAUNCH(order_rows_kernel, 1, kOrderThreads, stream, counts, rows, order);
  return cudaGetLastError();
}

cudaError_t prepare_routes(const AttentionParams& a, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream, std::int32_t* proxy_counts) {
  const int rows = a.route_rows;
  if (rows == 0) return cudaSuccess;
  return with_units(a.route, [&](auto units) {
    constexpr int kUnits = decltype(units)::value;
    constexpr int kRowsPerBlock = kRowThreads / 32;
    const int blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const bool proxy = a.route.proxy_mode != 0;
    const auto kernel = proxy ? prepare_routes_kernel<kUnits, true> : prepare_routes_kernel<kUnits, false>;
    BSATTN_LAUNCH(kernel, blocks, kRowThreads, stream, a.route, rows, routes, counts, proxy ? proxy_counts : nullptr,
                  overflow);
    return cudaGetLastError();
  });
}

cudaError_t derive_varlen_block_offsets(const route::RouteParams& p, std::int32_t* cu_m, std::int32_t* cu_idx,
                                        cudaStream_t stream) {
  BSATTN_LAUNCH(derive_offsets_kernel, 1, 1, stream, p, cu_m, cu_idx);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
