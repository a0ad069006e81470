// Plan / run and the one-shot entry point (SPEC §8).
#pragma once
#include <cstddef>
#include <memory>

#include "bsattn/problem.hpp"

namespace bsattn {

struct AttentionParams;
struct BackwardParams;
struct BackwardInputs;  // backward.hpp
struct Gradients;       // backward.hpp
namespace cpu {
struct Workspace;
}

using Stream = void*;  // a cudaStream_t on the GPU; ignored on the CPU

// The tiles chosen for a problem (SPEC §8, seed 002): the route stream is cut to them.
struct TileShape {
  int tile_m = 0, tile_n = 0;
  int unit_m = 0;         // rows per Q unit: min(Bq, tile_m)
  int units_per_tile = 0;  // tile_m / unit_m: Q blocks smaller than the tile share it
  int kv_split = 0;        // Bk / tile_n: KV tiles per KV block
  // GPU decode kernel (a few queries per sequence): query heads of one KV group packed into a
  // tile's 64 rows (tile_m = 64 / packed_heads tokens), and work items per (route row, head group)
  // over its KV routes, merged after the kernel. 0: the prefill kernels.
  int packed_heads = 0;
  int kv_splits = 0;
};

// plan() does the host work once: checks the problem, chooses tiles, sizes and allocates the
// workspace. run() prepares routes and runs attention; on the CPU it blocks until done, on the
// GPU it only launches (no host synchronisation, no allocation when validate is false).
class Plan {
 public:
  Plan();
  ~Plan();
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  explicit Plan(const Problem& problem) : Plan() { plan(problem); }

  // Throws bsattn::Error; on failure the previous plan stays usable.
  void plan(const Problem& problem);
  // Throws bsattn::Error before writing anything when an input is malformed.
  void run(const Inputs& inputs, const Outputs& outputs, Stream stream = nullptr);
  // GPU: waits for `stream` and throws bsattn::Error if the latest run() overflowed the route
  // capacity (without validation run() cannot know before attention; that run wrote no output).
  // CPU: nothing to do (run() throws before writing).
  void check(Stream stream = nullptr);

  bool planned() const;
  const Problem& problem() const;  // as given to plan()
  // The tiles the plan runs. A GPU prefill plan for the backward of format all_blocks with a wide
  // mask band takes those of blocks of 128 x 128 whatever problem.block says (docs/GPU.md,
  // "Tiles"): the block size of such a pattern does not change what is computed.
  const TileShape& tiles() const;
  int route_capacity() const;        // records per route row
  std::size_t workspace_bytes() const;

  // For custom_mask.hpp: validates and binds like run(), then calls engine(context, params,
  // workspace) in place of the built-in CPU engine.
  using CpuEngine = void (*)(const void* context, AttentionParams& params, const cpu::Workspace& workspace);
  void run_cpu_engine(const Inputs& inputs, const Outputs& outputs, CpuEngine engine, const void* context);

  // Gradients of the attention this plan computes (backward.hpp): validates like run() plus the
  // backward's tensors, then writes dQ, dK, dV. CPU plans only; throws bsattn::Error before
  // writing anything for paged KV, proxy routes, a GPU plan or malformed tensors.
  void run_backward(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                    Stream stream = nullptr);
  // For custom_mask.hpp: as run_backward(), with engine(context, params, workspace) in place of
  // the built-in CPU backward.
  using CpuBackwardEngine = void (*)(const void* context, BackwardParams& params, const cpu::Workspace& workspace);
  void run_cpu_backward_engine(const Inputs& inputs, const BackwardInputs& backward, const Gradients& gradients,
                               CpuBackwardEngine engine, const void* context);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// plan + run with full validation (problem.validate is forced on).
void attention(const Problem& problem, const Inputs& inputs, const Outputs& outputs, Stream stream = nullptr);

// The tiles plan() would choose (exposed for tools and tests).
TileShape choose_tiles(const Problem& problem);

}  // namespace bsattn
