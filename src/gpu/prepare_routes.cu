#include "gpu/prepare_routes.hpp"

#include <algorithm>
#include <type_traits>

#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/timeline.cuh"
#include "gpu/work_order.cuh"

// tests/gpu/emulation runs the kernels' logic on the host.
#if defined(BSATTN_GPU_HOST_EMULATION)
#define BSATTN_LAUNCH(kernel, blocks, threads, shared, stream, ...) \
  emulate_launch(kernel, dim3(blocks), threads, shared, __VA_ARGS__)
#else
#define BSATTN_LAUNCH(kernel, blocks, threads, shared, stream, ...) \
  kernel<<<blocks, threads, shared, stream>>>(__VA_ARGS__)
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

// The warp as the lanes of its cursors (route::BlockCursor::take_word): a block list is read 32
// entries a step, rather than a dependent load per entry in every lane.
struct WarpLanes {
  static constexpr int kSize = 32;
  int lane_;
  __device__ int lane() const { return lane_; }
  __device__ unsigned ballot(bool b) const { return __ballot_sync(0xffffffffu, b); }
  __device__ int shfl(int v, int src) const { return __shfl_sync(0xffffffffu, v, src); }
  __device__ std::uint32_t reduce_or(std::uint32_t v) const { return __reduce_or_sync(0xffffffffu, v); }
  __device__ int scan_max(int v, int* all) const {
    int x = v;
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane_ >= d) x = max(x, y);
    }
    *all = __shfl_sync(0xffffffffu, x, 31);
    const int below = __shfl_up_sync(0xffffffffu, x, 1);
    return lane_ ? below : -1;
  }
};

// A warp per row, lane i classifying block c0 + i of each 32-block chunk (prepare_row's steps,
// records placed by warp prefix sums in prepare_row's order); kProxy: then the row's proxy
// records. A thread per row walked every KV block of the row serially: nKB x rows steps with
// proxy routes (512 x 20480 at S = 32768 and blocks of 64), and for the few long rows of a decode
// step (one row of 1024 blocks at L = 131072) ~0.7 ms of one thread before the kernel could start.
// The lanes hold identical cursors (the same loads, broadcast; a list read by WarpLanes).
//
// kSplit (few long rows, all-blocks or bitmask sets): a block of W warps per row, warp w taking
// the w-th of W runs of consecutive chunks: a count pass, exclusive sums over the warps' exact
// and proxy counts, then the write pass from each warp's first exact and first proxy record, so
// the records land where prepare_row puts them. One warp walking the 32 chunks of a 1024-block
// decode row took 63 us (7 us for 64 blocks) while the other SMs idled. Block lists stay a warp
// per row: a list cursor reaches chunk c0 only by reading every entry before it (junk entries
// decide which later ones count), 32 a step.
constexpr int kRowThreads = 128;
// Named so that ptxas budgets 128 registers for the warp kernels: left to its default for a
// 128-thread block it took 64-80 and spilled 36-72 bytes beside the cursors' stack frame (the
// cursors are indexed by unit at run time, so they live in local memory either way).
constexpr int kRowBlocksPerSm = 4;
// At most 16 warps (512 threads) so that the launch bound leaves 128 registers: with 32 the
// compiler had 64 and spilled 40-334 bytes. The proxy kernels keep a third cursor per unit and sat
// at 128 registers with 0-8 bytes of spills from one ptxas run to the next: 8 warps (255 registers).
constexpr int max_split_warps(bool proxy) { return proxy ? 8 : 16; }
constexpr int kSplitWarpsInFlight = 4096;  // ~31 per SM of an H200: W = min(max_split_warps, chunks, this / rows)
constexpr int kMinSplitWarps = 4;          // below, two passes cost what the split saves

// The blocks [begin, end) of a row: the chunks of one warp (begin a multiple of 32).
struct BlockRun {
  int begin, end;
};

// Warp `part` of `parts`: the part-th of `parts` runs of the row's chunks.
template <int kUnits>
__device__ BlockRun block_run(const route::RowState<kUnits>& r, int part, int parts) {
  const int per_part = 32 * route::ceil_div(route::ceil_div(r.s.kv_blocks, 32), parts);
  return {min(part * per_part, r.s.kv_blocks), min((part + 1) * per_part, r.s.kv_blocks)};
}

// The exact records of blocks `run` of a row, written from out[at] (only counted at or past
// `capacity`; capacity 0: a count pass). Returns their number.
template <int kUnits>
__device__ int exact_pass(const route::RouteParams& p, route::RowState<kUnits>& r, BlockRun run, int lane,
                          route::Route* out, int capacity, int at) {
  route::ChunkWords<kUnits> w;
  int count = 0;
  for (int c0 = run.begin; c0 < run.end; c0 += 32) {
    route::take_chunk(p, r, c0, w, WarpLanes{lane});
    if (!w.selected) continue;
    const bool selected = (w.selected >> lane) & 1u;
    int n = 0;  // this lane's records: counted, then written after the lanes below it
    if (selected) route::exact_routes(p, r, w, c0, lane, [&](int, unsigned, unsigned) { ++n; });
    int total;
    int i = at + count + warp_exclusive_sum(n, lane, &total);
    if (selected && i < capacity)
      route::exact_routes(p, r, w, c0, lane, [&](int index, unsigned units, unsigned masked) {
        route::put_route(out, capacity, i++, index, route::RouteKind::exact, units, masked);
      });
    count += total;
  }
  return count;
}

// The proxy records of the same chunks (cursors opened again), as exact_pass.
template <int kUnits>
__device__ int proxy_pass(const route::RouteParams& p, route::RowState<kUnits>& r, BlockRun run, int lane,
                          route::Route* out, int capacity, int at) {
  route::ChunkWords<kUnits> w;
  int count = 0;
  for (int c0 = run.begin; c0 < run.end; c0 += 32) {
    route::take_chunk(p, r, c0, w, WarpLanes{lane});
    const unsigned units =
        c0 + lane < r.s.kv_blocks ? route::proxy_units(p, r, w, c0, lane, route::NoCustomMask()) : 0u;
    const unsigned ballot = __ballot_sync(0xffffffffu, units != 0);
    if (units)
      route::put_route(out, capacity, at + count + __popc(ballot & ((1u << lane) - 1u)), c0 + lane,
                       route::RouteKind::proxy, units, 0);
    count += __popc(ballot);
  }
  return count;
}

// The last block to finish publishes the launch's overflow flag (flags[3, 4] -> [0, 1]) and zeroes
// the pending pair and the block count for the next launch (prepare_routes.hpp). The pending
// values are taken by atomics: this multiprocessor's L1 may hold stale lines of them.
__device__ __forceinline__ void publish_overflow(std::int32_t* flags, std::uint64_t* timeline) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  fwd::timeline_mark(timeline, fwd::kPrepareWritten);
  __threadfence();
  if (atomicAdd(&flags[5], 1) != static_cast<int>(gridDim.x) - 1) return;
  __threadfence();
  const int row = atomicExch(&flags[3], 0), needed = atomicExch(&flags[4], 0);
  flags[0] = row;
  flags[1] = needed;
  atomicExch(&flags[5], 0);
  fwd::timeline_mark(timeline, fwd::kPreparePublished);
}

template <int kUnits, bool kProxy, bool kSplit>
__global__ void __launch_bounds__(kSplit ? 32 * max_split_warps(kProxy) : kRowThreads, kSplit ? 1 : kRowBlocksPerSm)
    prepare_routes_kernel(const route::RouteParams p, int rows, route::Route* routes, std::int32_t* counts,
                          std::int32_t* proxy_counts, std::int32_t* flags, std::uint64_t* timeline) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) fwd::timeline_mark(timeline, fwd::kPrepareEntry);
  // A decode kernel launched after this one (programmatic dependent launch) may be placed now; it
  // waits for this grid's completion before reading anything written here.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  if (p.values_invalid && *static_cast<const volatile std::int32_t*>(p.values_invalid) != 0) {
    publish_overflow(flags, timeline);  // a clear overflow flag: the host reports the bad value
    return;
  }
  const int parts = kSplit ? static_cast<int>(blockDim.x) / 32 : 1, part = kSplit ? warp : 0;
  const int row = kSplit ? static_cast<int>(blockIdx.x) : blockIdx.x * (kRowThreads / 32) + warp;
  if (row < rows) {  // the whole warp (kSplit: a block per row, always)
    route::Route* out = routes + static_cast<std::int64_t>(row) * p.capacity;
    route::RowState<kUnits> r;
    int count = 0, exact = 0;
    if (route::open_row(p, row, r)) {  // the same for the whole block
      if (threadIdx.x == 0) fwd::timeline_mark(timeline, fwd::kPrepareRowOpen);
      const BlockRun run = block_run(r, part, parts);
      int exact_at = 0, proxy_at = 0;
      if constexpr (kSplit) {
        extern __shared__ std::int32_t part_counts[];  // [2][parts]: exact, proxy records per warp
        const int n_exact = exact_pass(p, r, run, lane, out, 0, 0);
        int n_proxy = 0;
        if constexpr (kProxy) {
          route::open_cursors(p, r);
          n_proxy = proxy_pass(p, r, run, lane, out, 0, 0);
        }
        if (lane == 0) part_counts[part] = n_exact, part_counts[parts + part] = n_proxy;
        __syncthreads();
        if (threadIdx.x == 0) fwd::timeline_mark(timeline, fwd::kPrepareCounted);
        int total_exact, total_proxy;
        exact_at = warp_exclusive_sum(lane < parts ? part_counts[lane] : 0, lane, &total_exact);
        proxy_at = warp_exclusive_sum(lane < parts ? part_counts[parts + lane] : 0, lane, &total_proxy);
        exact_at = __shfl_sync(0xffffffffu, exact_at, part);
        proxy_at = total_exact + __shfl_sync(0xffffffffu, proxy_at, part);
        exact = total_exact;
        count = total_exact + total_proxy;
        route::open_cursors(p, r);
      }
      const int n_exact = exact_pass(p, r, run, lane, out, p.capacity, exact_at);
      if constexpr (!kSplit) exact = count = proxy_at = n_exact;
      if constexpr (kProxy) {
        route::open_cursors(p, r);
        const int n_proxy = proxy_pass(p, r, run, lane, out, p.capacity, proxy_at);
        if constexpr (!kSplit) count += n_proxy;
      }
    }
    if (part == 0 && lane == 0) {
      const int stored = count < p.capacity ? count : p.capacity;
      counts[row] = stored;
      if (proxy_counts) proxy_counts[row] = stored - (exact < p.capacity ? exact : p.capacity);  // the row's last records
      if (count > p.capacity && atomicCAS(&flags[3], 0, row + 1) == 0) {
        flags[4] = count;
        __threadfence();  // before publish_overflow's count of this block
      }
    }
  }
  publish_overflow(flags, timeline);
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

// A route row's work: its route count; live unless its Q tile starts past its sequence's end
// (checked only with `check_live`).
struct RouteRows {
  const std::int32_t* counts;
  route::RouteParams p;
  bool check_live;
  __device__ int operator()(int row) const { return counts[row]; }
  __device__ bool live(int row) const {
    if (!check_live) return true;
    const route::RowCoordinates rc = route::row_coordinates(p, row);
    const int seqlen_q = p.varlen_q ? p.cu_seqlens_q[rc.b + 1] - p.cu_seqlens_q[rc.b] : p.max_seqlen_q;
    return rc.q_tile * p.tile_m < seqlen_q;
  }
};

}  // namespace

RowOrder row_order_groups(const route::RouteParams& p) {
  // Rows are (b, hs, q_tile), q_tile fastest: the rows of sparsity heads that share a KV head are
  // consecutive (with fewer sparsity heads than KV heads, a row's items span several KV heads
  // and a group is one (b, hs)).
  RowOrder g;
  g.rows_per_group = std::max(1, p.max_q_tiles) * std::max(1, p.sparsity_heads / std::max(1, p.heads_kv));
  g.max_count = std::max(1, p.capacity);
  return g;
}

cudaError_t order_rows(const std::int32_t* counts, int rows, RowOrder groups, std::int32_t* order,
                       cudaStream_t stream, const route::RouteParams* route, std::int32_t* live_rows) {
  if (rows == 0) return cudaSuccess;
  const RouteRows work{counts, route ? *route : route::RouteParams{}, route != nullptr};
  BSATTN_LAUNCH(order_by_work_kernel<RouteRows>, 1, kOrderThreads, 0, stream, work, rows, groups, order, live_rows);
  return cudaGetLastError();
}

cudaError_t prepare_routes(const AttentionParams& a, route::Route* routes, std::int32_t* counts,
                           std::int32_t* overflow, cudaStream_t stream, std::int32_t* proxy_counts) {
  const int rows = a.route_rows;  // 0: one block still publishes a clear overflow flag
  const route::RouteParams& p = a.route;
  // Warps per row: several for a few long rows whose cursors can start at any chunk.
  const bool seekable = p.format == route::SetFormat::all_blocks || p.format == route::SetFormat::bitmask;
  const bool proxy = p.proxy_mode != 0;
  const int split = std::min(
      {max_split_warps(proxy), route::ceil_div(p.max_kv_blocks, 32), kSplitWarpsInFlight / std::max(rows, 1)});
  return with_units(p, [&](auto units) {
    constexpr int kUnits = decltype(units)::value;
    if (seekable && split >= kMinSplitWarps && rows > 0) {
      const auto kernel =
          proxy ? prepare_routes_kernel<kUnits, true, true> : prepare_routes_kernel<kUnits, false, true>;
      BSATTN_LAUNCH(kernel, rows, 32 * split, 2 * split * sizeof(std::int32_t), stream, p, rows, routes, counts,
                    proxy ? proxy_counts : nullptr, overflow, fwd::timeline_buffer(1));
    } else {
      constexpr int kRowsPerBlock = kRowThreads / 32;
      const auto kernel =
          proxy ? prepare_routes_kernel<kUnits, true, false> : prepare_routes_kernel<kUnits, false, false>;
      BSATTN_LAUNCH(kernel, std::max(1, (rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowThreads, 0, stream, p, rows, routes,
                    counts, proxy ? proxy_counts : nullptr, overflow, fwd::timeline_buffer(1));
    }
    return cudaGetLastError();
  });
}

cudaError_t derive_varlen_block_offsets(const route::RouteParams& p, std::int32_t* cu_m, std::int32_t* cu_idx,
                                        cudaStream_t stream) {
  BSATTN_LAUNCH(derive_offsets_kernel, 1, 1, 0, stream, p, cu_m, cu_idx);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
