#include "bsattn/plan.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bsattn/backward.hpp"
#include "bsattn/cpu/backward.hpp"
#include "bsattn/cpu/engine.hpp"
#include "formats/backward.hpp"
#include "formats/bind.hpp"
#include "formats/validate.hpp"
#if BSATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "gpu/attention.hpp"
#include "gpu/backward.hpp"
#include "gpu/check_values.hpp"
#include "gpu/bwd/dq_tiles.hpp"
#include "gpu/device_guard.hpp"
#include "gpu/device_info.hpp"
#include "gpu/prepare_routes.hpp"
#endif

namespace bsattn {

TileShape choose_tiles(const Problem& pb) {
  TileShape t;
  const int bq = pb.block.q, bk = pb.block.kv;
  if (pb.tile_m > 0) t.tile_m = pb.tile_m;
  else if (bq % 128 == 0) t.tile_m = 128;
  else if (bq % 64 == 0) t.tile_m = 64;
  else t.tile_m = 64;  // Bq of 16 or 32: several Q blocks share one tile, masked per unit
  t.unit_m = std::min(bq, t.tile_m);
  t.units_per_tile = t.unit_m > 0 ? t.tile_m / t.unit_m : 0;
  if (pb.tile_n > 0) {
    t.tile_n = pb.tile_n;
  } else {
    // The GPU kernels hold K and V tiles of tile_n x D in shared memory, double-buffered: at
    // D = 256 that caps the tile at 64 tokens (a 128-token KV block becomes two routes).
    const int max_n = (pb.device == Device::cuda && pb.head_dim > 128) ? 64 : 128;
    t.tile_n = 16;
    for (int n = max_n; n >= 16; n -= 16)
      if (bk % n == 0) {
        t.tile_n = n;
        break;
      }
  }
  t.kv_split = t.tile_n > 0 ? bk / t.tile_n : 0;
  return t;
}

#if BSATTN_WITH_CUDA
using gpu::cuda_check;
using gpu::DeviceGuard;

// The GPU decode kernel's shape (TileShape::packed_heads, kv_splits; gpu/fwd/decode.cuh), chosen
// when a tile of 64 rows holds every query of a sequence for P query heads: P the largest power of
// two up to 4 dividing both the KV group and the query heads of a sparsity head (so the packed
// heads share K/V tiles and routes), and max_seqlen_q <= 64 / P. More heads per tile would leave
// fewer than 16 tokens (tile_m is a multiple of 16). Not for an explicit tile_m, proxy routes, or
// a plan for the backward (whose kernels take the prefill tiles). Split-KV when the work items
// (sequences x head groups) leave multiprocessors idle: as many splits as fill them, each at
// least 4 routes long; their routes those of the decode kernel that merges them in clusters.
static void choose_decode(const Problem& pb, const route::RouteParams& geo, int routes_per_row, int sms,
                          TileShape& t) {
  if (pb.tile_m > 0 || pb.proxy != Proxy::off || pb.backward || pb.heads_kv <= 0) return;
  const int group = pb.heads_q / pb.heads_kv, per_sparsity_head = pb.heads_q / geo.sparsity_heads;
  int heads = 1;
  while (heads < 4 && group % (2 * heads) == 0 && per_sparsity_head % (2 * heads) == 0) heads *= 2;
  const int tokens = 64 / heads;
  if (pb.max_seqlen_q > tokens) return;
  t.tile_m = tokens;
  t.unit_m = std::min(pb.block.q, tokens);
  t.units_per_tile = tokens / t.unit_m;
  t.packed_heads = heads;
  t.kv_splits = 1;
  const std::int64_t items = static_cast<std::int64_t>(pb.batch) * (pb.heads_q / heads);
  if (items < sms)
    t.kv_splits = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(sms / items, routes_per_row / 4)));
  if (t.kv_splits > 1 && routes_per_row <= 8 * t.kv_splits) {
    // A short split step (at most 8 routes per split), whose time is mostly fixed costs: the route
    // width whose decode kernel fits two CTAs per multiprocessor, so that the splits merge in
    // clusters (gpu::decode_route_tile_n; B 1, L 8192: 23.1-23.5 -> 20.8-21.3 us). Long splits keep
    // the wide kernel's three stages (L 131072 was not measured with two). The splits stay those of
    // the KV blocks' width: as many tokens each, at most 16 (a cluster) where the blocks are 128 wide.
    const ElementType et = pb.dtype == DType::f16 ? ElementType::f16 : ElementType::bf16;
    t.tile_n = gpu::decode_route_tile_n(et, pb.head_dim, t.tile_n);
    t.kv_split = pb.block.kv / t.tile_n;
  }
  // Measurement switch (environment, read once): BSATTN_GPU_DECODE_SPLITS=N forces N splits.
  static const int forced_splits = [] {
    const char* v = std::getenv("BSATTN_GPU_DECODE_SPLITS");
    return v ? std::atoi(v) : 0;
  }();
  if (forced_splits > 0) t.kv_splits = forced_splits;
}

// Whether a GPU prefill plan for the backward (`tiles`: those of the caller's blocks) builds its
// routes from blocks of 128 x 128 instead. All blocks kept and a token-level mask: the block size
// does not change what is computed, only the tiles, and the backward's 128-wide kernels are the
// fastest (bf16, D 128, causal, blocks of 64: 1.37x, bench/RESULTS.md 2026-12-07 16:08). A
// forward-only plan keeps the caller's blocks: route pairs and packed heads run the forward on
// blocks of 64 x 64 as fast as on 128 x 128 (causal: 1.04x faster on blocks of 64, same run). Only where the
// mask's band is wide: route preparation skips the tiles a mask hides, and a tile of 128 x 128
// computes about W + 256 keys per row of a left window of W tokens against W + 128 on tiles of 64,
// more than the faster kernels gain below kWideWindow; document ids and KV validity bits hide
// tiles by their values, which the plan does not see. Not where the caller fixed the tiles or the
// route capacity (both counted in its blocks), not at D 256 (its tiles are 64 wide whatever the
// block), not for a decode plan (its tiles follow the queries).
static bool gpu_route_blocks_of_128(const Problem& pb, const TileShape& tiles) {
  constexpr int kWideWindow = 1024;
  if (!pb.backward || pb.format != Format::all_blocks || pb.proxy != Proxy::off || pb.tile_m > 0 ||
      pb.tile_n > 0 || pb.max_routes_per_row > 0 || pb.head_dim > 128 || tiles.packed_heads > 0)
    return false;
  const MaskSpec& m = pb.mask;
  if (m.document_ids || m.kv_valid_bits || (m.window_left >= 0 && m.window_left < kWideWindow)) return false;
  return tiles.tile_m != 128 || tiles.unit_m != 128 || tiles.tile_n != 128;
}

// The GPU plan's workspace: one cudaMalloc at plan time, carved into the overflow flag, route
// counts, derived varlen offsets and route records. run() allocates nothing.
struct DeviceWorkspace {
  // The overflow flag, the work counter and route preparation's own (gpu/prepare_routes.hpp):
  // zeroed here once; the kernels leave them ready for the next run.
  static constexpr std::size_t kFlagBytes = gpu::kRouteFlagWords * sizeof(std::int32_t);
  void* base = nullptr;
  std::size_t bytes = 0;
  int device = 0;
  std::int32_t* overflow = nullptr;  // [2]: {row + 1, routes needed} of an overflowing row, else 0
  std::int32_t* work_counter = nullptr;  // overflow + 2
  std::int32_t* counts = nullptr;
  std::int32_t* proxy_counts = nullptr;  // right after counts: the proxy records per row (proxy kernels)
  std::int32_t* row_order = nullptr;
  std::int32_t* cu_total_m_blocks = nullptr;
  std::int32_t* cu_block_idx_offsets = nullptr;
  route::Route* routes = nullptr;
  // The decode kernel's fp32 partial results when it splits KV (TileShape::kv_splits > 1), and its
  // arrival counts per (route row, head group), zeroed here once (the kernel leaves them zero).
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  std::int32_t* split_arrivals = nullptr;
  // The backward's storage (gpu/backward.hpp), after the routes; empty when `backward_refused`
  // says why this problem has no GPU backward.
  gpu::BackwardWorkspace backward;
  std::string backward_refused_field, backward_refused;

  DeviceWorkspace() = default;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  ~DeviceWorkspace() {
    if (base) {
      int now = 0;
      const bool restore = cudaGetDevice(&now) == cudaSuccess && now != device;
      if (restore) cudaSetDevice(device);
      cudaFree(base);
      if (restore) cudaSetDevice(now);
    }
  }

  // `partial_*_floats`: the decode splits' partial O and LSE, `split_units` their (route row, head
  // group) pairs (0 without splits).
  void allocate(int dev, std::int64_t rows, int capacity, int batch, const gpu::BackwardGeometry* backward_geometry,
                std::size_t partial_out_floats, std::size_t partial_lse_floats, std::size_t split_units) {
    device = dev;
    const auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
    const std::size_t off_counts = 256;
    const std::size_t off_order = off_counts + align(2 * static_cast<std::size_t>(rows) * sizeof(std::int32_t));
    const std::size_t off_cu_m = off_order + align(static_cast<std::size_t>(rows) * sizeof(std::int32_t));
    const std::size_t off_cu_idx = off_cu_m + align((batch + 1) * sizeof(std::int32_t));
    const std::size_t off_routes = off_cu_idx + align((batch + 1) * sizeof(std::int32_t));
    const std::size_t off_partial_out = align(off_routes + static_cast<std::size_t>(rows) * capacity * sizeof(route::Route));
    const std::size_t off_partial_lse = off_partial_out + align(partial_out_floats * sizeof(float));
    const std::size_t off_arrivals = off_partial_lse + align(partial_lse_floats * sizeof(float));
    const std::size_t off_backward = off_arrivals + align(split_units * sizeof(std::int32_t));
    bytes = off_backward + (backward_geometry ? gpu::BackwardWorkspace::bytes(*backward_geometry) : 0);
    DeviceGuard guard(dev);
    cuda_check(cudaMalloc(&base, bytes), "cudaMalloc (plan workspace)");
    char* p = static_cast<char*>(base);
    overflow = reinterpret_cast<std::int32_t*>(p);
    work_counter = overflow + 2;
    counts = reinterpret_cast<std::int32_t*>(p + off_counts);
    proxy_counts = counts + rows;
    row_order = reinterpret_cast<std::int32_t*>(p + off_order);
    cu_total_m_blocks = reinterpret_cast<std::int32_t*>(p + off_cu_m);
    cu_block_idx_offsets = reinterpret_cast<std::int32_t*>(p + off_cu_idx);
    routes = reinterpret_cast<route::Route*>(p + off_routes);
    if (partial_out_floats > 0) {
      partial_out = reinterpret_cast<float*>(p + off_partial_out);
      partial_lse = reinterpret_cast<float*>(p + off_partial_lse);
      split_arrivals = reinterpret_cast<std::int32_t*>(p + off_arrivals);
      cuda_check(cudaMemset(split_arrivals, 0, split_units * sizeof(std::int32_t)), "cudaMemset (plan workspace)");
    }
    if (backward_geometry) backward.carve(p + off_backward, *backward_geometry);
    cuda_check(cudaMemset(overflow, 0, kFlagBytes), "cudaMemset (plan workspace)");
  }
};

// The GPU backward's workspace for a problem, or the reason (field, message) it has none. Proxy
// routes and paged KV have no backward on any device (validate_backward says so).
static bool gpu_backward_geometry(const Problem& pb, const TileShape& tiles, const route::RouteParams& geo,
                                  gpu::BackwardGeometry& out, std::string& field, std::string& why) {
  const ElementType et = pb.dtype == DType::f16 ? ElementType::f16 : ElementType::bf16;
  if (!pb.backward) {
    field = "problem.backward";
    why = "false: this plan was made for the forward only; plan with problem.backward = true to run the backward "
          "on the GPU";
    return false;
  }
  if (pb.proxy != Proxy::off || pb.kv_layout == KVLayout::paged) {
    field = pb.proxy != Proxy::off ? "problem.proxy" : "problem.kv_layout";
    why = "the backward takes neither proxy routes nor paged KV";
    return false;
  }
  if (pb.out_dtype != pb.dtype) {
    field = "problem.out_dtype";
    why = std::string(to_string(pb.out_dtype)) + ": the GPU backward reads O and dO in the input dtype (" +
          to_string(pb.dtype) + "); plan with out_dtype = dtype or use Device::cpu";
    return false;
  }
  if (gpu::backward_kernel_block_n(et, pb.head_dim, tiles.tile_n) == 0) {
    field = "problem.head_dim";
    why = "no GPU backward kernel in this build for " + std::string(to_string(pb.dtype)) + ", head_dim " +
          std::to_string(pb.head_dim) + ", tile_n " + std::to_string(tiles.tile_n);
    return false;
  }
  const std::int64_t kv_tiles = route::ceil_div(geo.max_seqlen_kv, geo.tile_n);
  out.q_rows = pb.q_layout == QLayout::varlen ? pb.total_q : static_cast<std::int64_t>(pb.batch) * pb.max_seqlen_q;
  out.heads_q = pb.heads_q;
  out.head_dim = pb.head_dim;
  out.columns = static_cast<std::int64_t>(pb.batch) * geo.sparsity_heads * kv_tiles;
  out.ctas = static_cast<std::int64_t>(pb.batch) * pb.heads_kv * kv_tiles;
  out.column_capacity = geo.max_q_tiles;
  out.semaphores = static_cast<std::int64_t>(pb.batch) * pb.heads_q * geo.max_q_tiles;
  out.dq_tiles = gpu::bwd::dq_tiles_per_head(geo.tile_m, pb.q_layout == QLayout::varlen, pb.batch, pb.max_seqlen_q,
                                             pb.total_q);
  return true;
}
#else
struct DeviceWorkspace {};
#endif

struct Plan::Impl {
  Problem requested;  // as given to plan(): Plan::problem()
  Problem problem;    // what the routes are built from (gpu_route_blocks_of_128 may change the block size)
  TileShape tiles;
  int capacity = 0;
  std::vector<route::Route> routes;
  std::vector<std::int32_t> counts;
  std::vector<std::int32_t> cu_total_m_blocks, cu_block_idx_offsets;  // derived when not given
  std::size_t scratch_per_thread = 0;
  std::vector<float> scratch;
  std::unique_ptr<cpu::ThreadPool> pool;
  std::unique_ptr<DeviceWorkspace> device;  // Device::cuda only

  void run(const Inputs& inputs, const Outputs& outputs, Plan::CpuEngine engine, const void* context);
  void run_backward(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                    Plan::CpuBackwardEngine engine, const void* context);
  cpu::Workspace cpu_workspace();
  void run_gpu(const Inputs& inputs, const Outputs& outputs, Stream stream);
  // validate_structure reads only the problem and the views, so a run() whose views are
  // byte-identical to the latest checked ones (the same tensors again) skips it (issue 14.3).
  // Equal bytes imply equal members; differing padding only costs a check.
  void check_structure_once(const Inputs& inputs, const Outputs& outputs);
  Inputs checked_inputs;
  Outputs checked_outputs;
  bool structure_checked = false;
  void prepare_gpu_routes(AttentionParams& a, Stream stream, bool launch = true);
#if BSATTN_WITH_CUDA
  void run_decode_splits(const AttentionParams& a, const gpu::TokenExtents& extents, gpu::DecodeShape& decode,
                         cudaStream_t s);
#endif
  void run_backward_gpu(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                        Stream stream);
  // validate = true on the GPU: the value checks as device kernels (gpu/check_values.hpp); their
  // flag is read with the overflow flag by check_gpu(stream, &inputs).
  void check_values_on_device(route::RouteParams& route, const Inputs& inputs, Stream stream);
  // Reads the device flags (one small copy) and throws on a raised one: the overflow, or, given
  // the run's inputs, the value checks' flag (then the host names the bad value).
  void check_gpu(Stream stream, const Inputs* validated = nullptr);
};

Plan::Plan() = default;
Plan::~Plan() = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

bool Plan::planned() const { return impl_ != nullptr; }

static Plan::Impl& require(const std::unique_ptr<Plan::Impl>& impl) {
  if (!impl) throw Error("plan", "run() or a query before a successful plan()");
  return *impl;
}

const Problem& Plan::problem() const { return require(impl_).requested; }
const TileShape& Plan::tiles() const { return require(impl_).tiles; }
int Plan::route_capacity() const { return require(impl_).capacity; }
std::size_t Plan::workspace_bytes() const {
  const Impl& i = require(impl_);
#if BSATTN_WITH_CUDA
  if (i.device) return i.device->bytes;
#endif
  return i.routes.size() * sizeof(route::Route) + i.counts.size() * sizeof(std::int32_t) +
         i.scratch.size() * sizeof(float) +
         (i.cu_total_m_blocks.size() + i.cu_block_idx_offsets.size()) * sizeof(std::int32_t);
}

void Plan::plan(const Problem& requested) {
  auto next = std::make_unique<Impl>();
  next->requested = requested;
  next->problem = requested;
  const Problem& problem = next->problem;  // gpu_route_blocks_of_128 may change its block size below
  next->tiles = choose_tiles(problem);
  formats::validate_problem(problem, next->tiles);
  if (problem.device == Device::cuda) {
#if BSATTN_WITH_CUDA
    if (problem.dtype != DType::bf16 && problem.dtype != DType::f16)
      throw Error("problem.dtype", std::string(to_string(problem.dtype)) + ": the GPU kernels take f16 or bf16");
    if (problem.out_dtype != DType::bf16 && problem.out_dtype != DType::f16 && problem.out_dtype != DType::f32)
      throw Error("problem.out_dtype", std::string(to_string(problem.out_dtype)) + ": expected f16, bf16 or f32");
    // The kernels take each row's max of the raw scores and mask with -inf: both assume scale > 0.
    if (problem.scale < 0.0f)
      throw Error("problem.scale", std::to_string(problem.scale) +
                                       ": the GPU kernels take a positive scale (0 means 1/sqrt(head_dim)); a negative "
                                       "scale is the positive one applied to -Q; or use Device::cpu");
    if (problem.kv_layout == KVLayout::paged && problem.page_size % 16 != 0)
      throw Error("problem.page_size", std::to_string(problem.page_size) +
                                           ": the GPU kernels take pages of a multiple of 16 tokens; use Device::cpu");
    const ElementType et = problem.dtype == DType::f16 ? ElementType::f16 : ElementType::bf16;
    {
      DeviceGuard guard(problem.device_index);
      const route::RouteParams prefill = formats::route_geometry(problem, next->tiles, 0);
      TileShape decode = next->tiles;
      choose_decode(problem, prefill, prefill.max_kv_blocks * next->tiles.kv_split,
                    gpu::multiprocessors(problem.device_index), decode);
      if (decode.packed_heads > 0 &&
          gpu::forward_kernel_block_n(et, problem.head_dim, decode.tile_m, decode.tile_n, false, true) != 0)
        next->tiles = decode;
      else if (gpu_route_blocks_of_128(problem, next->tiles)) {
        next->problem.block = BlockSize{128, 128};
        next->tiles = choose_tiles(problem);
      }
      // Prefill tiles of 64 rows and one query head have one consumer warpgroup: the GPU takes the
      // route width whose kernel fits two CTAs per multiprocessor (gpu::prefill_route_tile_n; a KV
      // block of 128 then becomes two routes). Not for proxy routes (a window per 64 blocks costs
      // more than one per 128) nor a plan for the backward (its kernels take the forward's tiles).
      TileShape& t = next->tiles;
      if (t.packed_heads == 0 && problem.tile_n == 0 && problem.proxy == Proxy::off && !problem.backward) {
        t.tile_n = gpu::prefill_route_tile_n(et, problem.head_dim, formats::route_geometry(problem, t, 0));
        t.kv_split = problem.block.kv / t.tile_n;
      }
    }
    if (gpu::forward_kernel_block_n(et, problem.head_dim, next->tiles.tile_m, next->tiles.tile_n, false,
                                    next->tiles.packed_heads > 0) == 0)
      throw Error("problem.head_dim", "no GPU kernel in this build for " + std::string(to_string(problem.dtype)) +
                                          ", head_dim " + std::to_string(problem.head_dim) + ", tile " +
                                          std::to_string(next->tiles.tile_m) + "x" + std::to_string(next->tiles.tile_n) +
                                          " (see BSATTN_GPU_DTYPES / BSATTN_GPU_HEAD_DIMS)");
#else
    throw Error("problem.device", "cuda: this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use Device::cpu");
#endif
  }

  const route::RouteParams geo = formats::route_geometry(problem, next->tiles, 0);
  const std::int64_t full_capacity =
      static_cast<std::int64_t>(geo.max_kv_blocks) * next->tiles.kv_split + (problem.proxy != Proxy::off ? geo.max_kv_blocks : 0);
  next->capacity = problem.max_routes_per_row > 0 ? problem.max_routes_per_row : static_cast<int>(std::max<std::int64_t>(1, full_capacity));
  const std::int64_t rows = static_cast<std::int64_t>(problem.batch) * geo.sparsity_heads * geo.max_q_tiles;
#if BSATTN_WITH_CUDA
  if (problem.device == Device::cuda) {
    if (rows * next->capacity > (std::int64_t(1) << 31))
      throw Error("max_routes_per_row", "route workspace of " + std::to_string(rows * next->capacity) +
                                            " records exceeds the int32 range");
    next->device = std::make_unique<DeviceWorkspace>();
    // The backward's workspace (its fp32 dQ accumulator is 4 bytes per element of Q) is sized and
    // allocated here with the forward's, so run_backward() allocates nothing.
    gpu::BackwardGeometry backward;
    DeviceWorkspace& ws = *next->device;
    const bool has_backward =
        gpu_backward_geometry(problem, next->tiles, geo, backward, ws.backward_refused_field, ws.backward_refused);
    const TileShape& t = next->tiles;
    const std::int64_t q_rows = problem.q_layout == QLayout::varlen
                                    ? problem.total_q
                                    : static_cast<std::int64_t>(problem.batch) * problem.max_seqlen_q;
    const std::size_t partial_rows = t.kv_splits > 1 ? static_cast<std::size_t>(t.kv_splits * q_rows * problem.heads_q) : 0;
    const std::size_t split_units =
        t.kv_splits > 1 ? static_cast<std::size_t>(rows * (problem.heads_q / geo.sparsity_heads / t.packed_heads)) : 0;
    ws.allocate(problem.device_index, rows, next->capacity, problem.batch, has_backward ? &backward : nullptr,
                partial_rows * problem.head_dim, partial_rows, split_units);
    {
      DeviceGuard guard(problem.device_index);
      const ElementType et = problem.dtype == DType::f16 ? ElementType::f16 : ElementType::bf16;
      cuda_check(gpu::configure_forward(et, problem.head_dim, t.tile_m, t.tile_n, problem.proxy != Proxy::off,
                                        t.packed_heads > 0),
                 "configure forward kernel");
      if (has_backward)
        cuda_check(gpu::configure_backward(et, problem.head_dim, next->tiles.tile_n), "configure backward kernel");
    }
    impl_ = std::move(next);
    return;
  }
#endif
  next->routes.resize(static_cast<std::size_t>(rows * next->capacity));
  next->counts.resize(static_cast<std::size_t>(rows));
  if (problem.q_layout == QLayout::varlen) {
    next->cu_total_m_blocks.resize(problem.batch + 1);
    next->cu_block_idx_offsets.resize(problem.batch + 1);
  }
  const int threads = problem.num_threads > 0 ? problem.num_threads
                                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  next->pool = std::make_unique<cpu::ThreadPool>(threads);
  // Sized for the forward and the backward alike (the backward's is about twice as large).
  next->scratch_per_thread =
      std::max(cpu::scratch_floats(next->tiles.tile_m, next->tiles.tile_n, problem.head_dim),
               cpu::backward_scratch_floats(next->tiles.tile_m, next->tiles.tile_n, problem.head_dim));
  next->scratch.resize(next->scratch_per_thread * next->pool->size());
  impl_ = std::move(next);
}

// Varlen formats index through cu_total_m_blocks / cu_block_idx_offsets; when the caller gives
// none, `derive(params, m, o)` fills the plan's storage m, o from the sequence lengths.
template <class Derive>
static void attach_varlen_block_offsets(route::RouteParams& p, std::int32_t* m, std::int32_t* o, const Derive& derive) {
  if (!p.varlen_q || p.format == route::SetFormat::all_blocks || p.format == route::SetFormat::block_lists) return;
  if (p.cu_total_m_blocks && p.cu_block_idx_offsets) return;
  derive(p, m, o);
  if (!p.cu_total_m_blocks) p.cu_total_m_blocks = m;
  if (!p.cu_block_idx_offsets) p.cu_block_idx_offsets = o;
}

void Plan::Impl::run(const Inputs& inputs, const Outputs& outputs, Plan::CpuEngine engine, const void* context) {
  formats::validate_structure(problem, inputs, outputs);
  if (problem.validate) formats::validate_values(problem, tiles, inputs);
  AttentionParams a = formats::bind(problem, tiles, capacity, inputs, outputs);
  attach_varlen_block_offsets(a.route, cu_total_m_blocks.data(), cu_block_idx_offsets.data(),
                              route::varlen_block_offsets);
  engine(context, a, cpu_workspace());
}

cpu::Workspace Plan::Impl::cpu_workspace() {
  cpu::Workspace ws;
  ws.routes = routes.data();
  ws.counts = counts.data();
  ws.pool = pool.get();
  ws.scratch = scratch.data();
  ws.scratch_per_thread = scratch_per_thread;
  return ws;
}

// Backward on the CPU engine: the forward's checks and binding plus the backward's tensors, all
// before the engine writes anything.
void Plan::Impl::run_backward(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                              Plan::CpuBackwardEngine engine, const void* context) {
  if (problem.device != Device::cpu)
    throw Error("problem.device", "cuda: a custom mask functor runs on the CPU engine only; plan for Device::cpu");
  formats::validate_backward(problem, inputs, backward, gradients);
  if (problem.validate) formats::validate_values(problem, tiles, inputs);
  BackwardParams g = formats::bind_backward(problem, tiles, capacity, inputs, backward, gradients);
  attach_varlen_block_offsets(g.fwd.route, cu_total_m_blocks.data(), cu_block_idx_offsets.data(),
                              route::varlen_block_offsets);
  engine(context, g, cpu_workspace());
}

#if BSATTN_WITH_CUDA
// GPU run: bind device pointers, derive varlen offsets when not given, prepare routes, attend;
// all on `stream`, no allocation. Without validation nothing synchronises with the host: a
// route-capacity overflow raises the device flag, the attention kernel then writes nothing, and
// Plan::check() reports it. With validation (which already copies metadata to the host) run()
// waits for route preparation and throws on overflow before attention is launched.
void Plan::Impl::run_gpu(const Inputs& inputs, const Outputs& outputs, Stream stream) {
  check_structure_once(inputs, outputs);
  AttentionParams a = formats::bind(problem, tiles, capacity, inputs, outputs);
  DeviceGuard guard(problem.device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  DeviceWorkspace& ws = *device;
  route::RouteParams& p = a.route;
  if (problem.validate) check_values_on_device(p, inputs, stream);
  // The work order (grouped by K/V, longest rows first) only matters when work items queue for
  // multiprocessors; with fewer (a decode step: a few rows, split over the SMs) the rows run in
  // index order and the sort's launch (a few us of a ~20 us step) is saved.
  // (The decode kernel packs packed_heads query heads into an item: counting them one by one made a
  // B = 1 step with 8 KV heads x 16 splits look like 512 items and sort for 3 us.)
  const std::int64_t items_at_most = static_cast<std::int64_t>(a.route_rows) *
                                     (p.heads_q / p.sparsity_heads / std::max(1, tiles.packed_heads)) *
                                     std::max(1, tiles.kv_splits);
  const bool items_fit = items_at_most <= gpu::multiprocessors(problem.device_index);
  // A run whose routes follow from the sequence lengths (all blocks, positional mask only:
  // route/prepare.hpp) and whose rows need no sort is one launch: the kernel makes its routes (a
  // decode step, or a prefill small enough that its work items all start at once: issue 14's
  // host time).
  a.routes_from_lengths = items_fit && route::routes_follow_lengths(p);
  prepare_gpu_routes(a, stream, !a.routes_from_lengths);
  if (!items_fit) {
    std::int32_t* live_rows = ws.overflow + gpu::kLiveRowsWord;
    cuda_check(gpu::order_rows(ws.counts, a.route_rows, gpu::row_order_groups(p), ws.row_order, s, &p, live_rows),
               "order_rows");
    a.live_rows = live_rows;
  } else {
    a.row_order = nullptr;
    a.live_rows = nullptr;
  }
  if (problem.validate) check_gpu(stream, &inputs);
  // Token extents of Q and K/V (the bounds of the kernel's bulk tensor copies).
  gpu::TokenExtents extents;
  extents.q = inputs.q.shape[p.varlen_q ? 0 : 1];
  const int tdim = p.varlen_kv ? 0 : 1;
  extents.kv = std::min(inputs.k.shape[tdim], inputs.v.shape[tdim]);
  if (p.paged) extents.kv_pages = std::min(inputs.k.shape[0], inputs.v.shape[0]);
  if (tiles.packed_heads == 0) {
    cuda_check(gpu::run_forward(a, extents, ws.overflow, s), "forward kernel launch");
    return;
  }
  gpu::DecodeShape decode;
  decode.packed_heads = tiles.packed_heads;
  decode.kv_splits = tiles.kv_splits;
  if (tiles.kv_splits == 1) {
    cuda_check(gpu::run_forward(a, extents, ws.overflow, s, &decode), "forward kernel launch");
    return;
  }
  run_decode_splits(a, extents, decode, s);
}

// Split-KV decode: the kernel writes each split's normalised O and LSE in fp32, laid out as the
// outputs (batched [B, Sq, H, D] / [B, H, Sq], varlen [total_q, H, D] / [H, total_q]) split after
// split, and the last split of each (route row, head group) merges them into the caller's outputs
// (fwd/decode.cuh merge_splits; nothing after a route overflow, and varlen rows past the
// sequences left alone, as the kernel leaves them).
void Plan::Impl::run_decode_splits(const AttentionParams& a, const gpu::TokenExtents& extents,
                                   gpu::DecodeShape& decode, cudaStream_t s) {
  DeviceWorkspace& ws = *device;
  const bool varlen = a.route.varlen_q;
  const std::int64_t B = varlen ? 1 : problem.batch, Sq = varlen ? problem.total_q : problem.max_seqlen_q;
  const std::int64_t H = problem.heads_q, D = problem.head_dim;
  decode.out_split_step = B * Sq * H * D;
  decode.lse_split_step = B * H * Sq;
  AttentionParams splits = a;
  splits.out = ws.partial_out;
  splits.out_type = ElementType::f32;
  splits.out_batch_stride = Sq * H * D;
  splits.out_token_stride = H * D;
  splits.out_head_stride = D;
  splits.lse = ws.partial_lse;
  splits.lse_batch_stride = H * Sq;
  splits.lse_head_stride = Sq;
  splits.lse_token_stride = 1;
  decode.result_type = a.out_type;
  decode.result.out = a.out;
  decode.result.out_batch_stride = a.out_batch_stride;  // varlen: merge_splits takes batch 0, row q_base + q
  decode.result.out_token_stride = a.out_token_stride;
  decode.result.out_head_stride = a.out_head_stride;
  decode.result.lse = a.lse;
  decode.result.lse_batch_stride = a.lse_batch_stride;
  decode.result.lse_head_stride = a.lse_head_stride;
  decode.result.lse_token_stride = a.lse_token_stride;
  decode.split_arrivals = ws.split_arrivals;
  cuda_check(gpu::run_forward(splits, extents, ws.overflow, s, &decode), "forward kernel launch");
}

// Derives varlen offsets when not given, binds the workspace and prepares the route stream on
// `stream` (forward and backward alike). No memset: route preparation writes the overflow flag
// every run and the kernels leave the counters zero (gpu/prepare_routes.hpp). `launch` false: a
// decode kernel makes its routes from the lengths; the flags stay as the plan zeroed them.
void Plan::Impl::prepare_gpu_routes(AttentionParams& a, Stream stream, bool launch) {
  const auto s = static_cast<cudaStream_t>(stream);
  DeviceWorkspace& ws = *device;
  attach_varlen_block_offsets(a.route, ws.cu_total_m_blocks, ws.cu_block_idx_offsets,
                              [s](const route::RouteParams& q, std::int32_t* m, std::int32_t* o) {
                                cuda_check(gpu::derive_varlen_block_offsets(q, m, o, s), "derive_varlen_block_offsets");
                              });
  a.routes = ws.routes;
  a.route_counts = ws.counts;
  a.row_order = ws.row_order;
  a.work_counter = ws.work_counter;
  if (a.route.proxy_mode != 0) a.route_proxy_counts = ws.proxy_counts;
  if (!launch) return;
  cuda_check(gpu::prepare_routes(a, ws.routes, ws.counts, ws.overflow, s,
                                 a.route.proxy_mode != 0 ? ws.proxy_counts : nullptr),
             "prepare_routes");
}

// GPU backward: the checks and binding of the CPU path, then route preparation and the backward
// kernels (gpu/backward.hpp) on `stream`: no allocation, and no host sync without validation (an
// overflow then writes nothing and Plan::check() reports it).
void Plan::Impl::run_backward_gpu(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                                  Stream stream) {
  formats::validate_backward(problem, inputs, backward, gradients);
  DeviceWorkspace& ws = *device;
  if (!ws.backward_refused.empty()) throw Error(ws.backward_refused_field, ws.backward_refused);
  BackwardParams g = formats::bind_backward(problem, tiles, capacity, inputs, backward, gradients);
  DeviceGuard guard(problem.device_index);
  if (problem.validate) check_values_on_device(g.fwd.route, inputs, stream);
  prepare_gpu_routes(g.fwd, stream);
  if (problem.validate) check_gpu(stream, &inputs);
  cuda_check(gpu::run_backward(g, ws.backward, ws.overflow, problem.deterministic, static_cast<cudaStream_t>(stream)),
             "backward kernel launch");
}

void Plan::Impl::check_structure_once(const Inputs& inputs, const Outputs& outputs) {
  static_assert(std::is_trivially_copyable_v<Inputs> && std::is_trivially_copyable_v<Outputs>, "kept as bytes");
  if (structure_checked && std::memcmp(&inputs, &checked_inputs, sizeof inputs) == 0 &&
      std::memcmp(&outputs, &checked_outputs, sizeof outputs) == 0)
    return;
  structure_checked = false;
  formats::validate_structure(problem, inputs, outputs);
  std::memcpy(&checked_inputs, &inputs, sizeof inputs);  // padding too, so the same caller's bytes compare equal
  std::memcpy(&checked_outputs, &outputs, sizeof outputs);
  structure_checked = true;
}

void Plan::Impl::check_values_on_device(route::RouteParams& route, const Inputs& inputs, Stream stream) {
  DeviceWorkspace& ws = *device;
  cuda_check(gpu::check_values(formats::value_check_params(problem, tiles, inputs), ws.overflow, ws.cu_total_m_blocks,
                               ws.cu_block_idx_offsets, static_cast<cudaStream_t>(stream)),
             "check_values");
  route.values_invalid = ws.overflow + gpu::kValuesInvalidWord;
}

void Plan::Impl::check_gpu(Stream stream, const Inputs* validated) {
  DeviceGuard guard(problem.device_index);
  std::int32_t flag[gpu::kRouteFlagWords] = {};
  const auto copied = [&](cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    std::string message = std::string(what) + " failed: " + cudaGetErrorString(e);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (validated && cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) == cudaSuccess &&
        capture != cudaStreamCaptureStatusNone)
      message += " (validate = true reads the value checks' flag on the host, which CUDA graph capture forbids: "
                 "capture with validate = false)";
    throw Error(validated ? "problem.validate" : "cuda", message);
  };
  copied(cudaMemcpyAsync(flag, device->overflow, sizeof flag, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
         "cudaMemcpyAsync (device flags)");
  copied(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  if (validated && flag[gpu::kValuesInvalidWord] != 0) {
    formats::validate_values(problem, tiles, *validated);  // throws, naming the first bad value
    throw Error("problem.validate", "the device value checks rejected the metadata, but the host checks found no bad "
                                    "value (a bsattn defect: please report it with the problem)");
  }
  if (flag[0] != 0) {
    const route::RowCoordinates c = route::row_coordinates(formats::route_geometry(problem, tiles, capacity), flag[0] - 1);
    throw Error("max_routes_per_row", "route row (b=" + std::to_string(c.b) + ", hs=" + std::to_string(c.hs) +
                                          ", q_tile=" + std::to_string(c.q_tile) + ") needs " + std::to_string(flag[1]) +
                                          " routes; capacity is " + std::to_string(capacity) +
                                          " (the run wrote no output)");
  }
}
#endif

void Plan::check(Stream stream) {
  Impl& impl = require(impl_);
#if BSATTN_WITH_CUDA
  if (impl.device) impl.check_gpu(stream);
#else
  (void)impl;
  (void)stream;
#endif
}

void Plan::run(const Inputs& inputs, const Outputs& outputs, Stream stream) {
  Impl& impl = require(impl_);
#if BSATTN_WITH_CUDA
  if (impl.device) {
    impl.run_gpu(inputs, outputs, stream);
    return;
  }
#else
  (void)stream;
#endif
  impl.run(inputs, outputs,
           [](const void*, AttentionParams& a, const cpu::Workspace& ws) { cpu::run(a, ws, cpu::NoTokenMask{}); },
           nullptr);
}

void Plan::run_cpu_engine(const Inputs& inputs, const Outputs& outputs, CpuEngine engine, const void* context) {
  Impl& impl = require(impl_);
  if (impl.problem.device != Device::cpu)
    throw Error("problem.device", "a custom mask functor runs on the CPU engine only; plan for Device::cpu");
  impl.run(inputs, outputs, engine, context);
}

void Plan::run_backward(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                        Stream stream) {
  Impl& impl = require(impl_);
#if BSATTN_WITH_CUDA
  if (impl.device) {
    impl.run_backward_gpu(inputs, backward, gradients, stream);
    return;
  }
#else
  (void)stream;
#endif
  impl.run_backward(
      inputs, backward, gradients,
      [](const void*, BackwardParams& g, const cpu::Workspace& ws) { cpu::run_backward(g, ws, cpu::NoTokenMask{}); },
      nullptr);
}

void Plan::run_cpu_backward_engine(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                                   CpuBackwardEngine engine, const void* context) {
  require(impl_).run_backward(inputs, backward, gradients, engine, context);
}

void attention_backward(const Problem& problem, const Inputs& inputs, const BackwardInputs& backward,
                        const Gradients& gradients, Stream stream) {
  Problem p = problem;
  p.validate = true;
  p.backward = true;
  Plan plan(p);
  plan.run_backward(inputs, backward, gradients, stream);
}

void attention(const Problem& problem, const Inputs& inputs, const Outputs& outputs, Stream stream) {
  Problem p = problem;
  p.validate = true;
  Plan plan(p);
  plan.run(inputs, outputs, stream);
}

}  // namespace bsattn
