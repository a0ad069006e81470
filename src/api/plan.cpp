#include "bsattn/plan.hpp"

#include <algorithm>
#include <thread>
#include <vector>

#include "bsattn/cpu/engine.hpp"
#include "formats/bind.hpp"
#include "formats/validate.hpp"

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
    t.tile_n = 16;
    for (int n = 128; n >= 16; n -= 16)
      if (bk % n == 0) {
        t.tile_n = n;
        break;
      }
  }
  t.kv_split = t.tile_n > 0 ? bk / t.tile_n : 0;
  return t;
}

struct Plan::Impl {
  Problem problem;
  TileShape tiles;
  int capacity = 0;
  std::vector<route::Route> routes;
  std::vector<std::int32_t> counts;
  std::vector<std::int32_t> cu_total_m_blocks, cu_block_idx_offsets;  // derived when not given
  std::size_t scratch_per_thread = 0;
  std::vector<float> scratch;
  std::unique_ptr<cpu::ThreadPool> pool;

  void run(const Inputs& inputs, const Outputs& outputs, Plan::CpuEngine engine, const void* context);
  void derive_varlen_block_offsets(AttentionParams& a);
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

const Problem& Plan::problem() const { return require(impl_).problem; }
const TileShape& Plan::tiles() const { return require(impl_).tiles; }
int Plan::route_capacity() const { return require(impl_).capacity; }
std::size_t Plan::workspace_bytes() const {
  const Impl& i = require(impl_);
  return i.routes.size() * sizeof(route::Route) + i.counts.size() * sizeof(std::int32_t) +
         i.scratch.size() * sizeof(float) +
         (i.cu_total_m_blocks.size() + i.cu_block_idx_offsets.size()) * sizeof(std::int32_t);
}

void Plan::plan(const Problem& problem) {
  auto next = std::make_unique<Impl>();
  next->problem = problem;
  next->tiles = choose_tiles(problem);
  formats::validate_problem(problem, next->tiles);
  if (problem.device != Device::cpu)
    throw Error("problem.device", "cuda: the GPU attention engine is not available in this build yet; use Device::cpu");

  const route::RouteParams geo = formats::route_geometry(problem, next->tiles, 0);
  const std::int64_t full_capacity =
      static_cast<std::int64_t>(geo.max_kv_blocks) * next->tiles.kv_split + (problem.proxy != Proxy::off ? geo.max_kv_blocks : 0);
  next->capacity = problem.max_routes_per_row > 0 ? problem.max_routes_per_row : static_cast<int>(std::max<std::int64_t>(1, full_capacity));
  const std::int64_t rows = static_cast<std::int64_t>(problem.batch) * geo.sparsity_heads * geo.max_q_tiles;
  next->routes.resize(static_cast<std::size_t>(rows * next->capacity));
  next->counts.resize(static_cast<std::size_t>(rows));
  if (problem.q_layout == QLayout::varlen) {
    next->cu_total_m_blocks.resize(problem.batch + 1);
    next->cu_block_idx_offsets.resize(problem.batch + 1);
  }
  const int threads = problem.num_threads > 0 ? problem.num_threads
                                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  next->pool = std::make_unique<cpu::ThreadPool>(threads);
  next->scratch_per_thread = cpu::scratch_floats(next->tiles.tile_m, next->tiles.tile_n, problem.head_dim);
  next->scratch.resize(next->scratch_per_thread * next->pool->size());
  impl_ = std::move(next);
}

// Varlen formats index through cu_total_m_blocks / cu_block_idx_offsets; when the caller gives
// none, they follow from the sequence lengths.
void Plan::Impl::derive_varlen_block_offsets(AttentionParams& a) {
  route::RouteParams& p = a.route;
  if (!p.varlen_q || p.format == route::SetFormat::all_blocks || p.format == route::SetFormat::block_lists) return;
  if (p.cu_total_m_blocks && p.cu_block_idx_offsets) return;
  route::varlen_block_offsets(p, cu_total_m_blocks.data(), cu_block_idx_offsets.data());
  if (!p.cu_total_m_blocks) p.cu_total_m_blocks = cu_total_m_blocks.data();
  if (!p.cu_block_idx_offsets) p.cu_block_idx_offsets = cu_block_idx_offsets.data();
}

void Plan::Impl::run(const Inputs& inputs, const Outputs& outputs, Plan::CpuEngine engine, const void* context) {
  formats::validate_structure(problem, inputs, outputs);
  if (problem.validate) formats::validate_values(problem, tiles, inputs);
  AttentionParams a = formats::bind(problem, tiles, capacity, inputs, outputs);
  derive_varlen_block_offsets(a);
  cpu::Workspace ws;
  ws.routes = routes.data();
  ws.counts = counts.data();
  ws.pool = pool.get();
  ws.scratch = scratch.data();
  ws.scratch_per_thread = scratch_per_thread;
  engine(context, a, ws);
}

void Plan::run(const Inputs& inputs, const Outputs& outputs, Stream) {
  Impl& impl = require(impl_);
  impl.run(inputs, outputs,
           [](const void*, AttentionParams& a, const cpu::Workspace& ws) { cpu::run(a, ws, cpu::NoTokenMask{}); },
           nullptr);
}

void Plan::run_cpu_engine(const Inputs& inputs, const Outputs& outputs, CpuEngine engine, const void* context) {
  Impl& impl = require(impl_);
  impl.run(inputs, outputs, engine, context);
}

void attention(const Problem& problem, const Inputs& inputs, const Outputs& outputs, Stream stream) {
  Problem p = problem;
  p.validate = true;
  Plan plan(p);
  plan.run(inputs, outputs, stream);
}

}  // namespace bsattn
