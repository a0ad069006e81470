// Workloads for the CLI and the benchmarks: a problem description (sizes, layout, mask, block
// pattern), the host tensors built from it, density accounting and an independent float64
// reference on sampled rows. The one place where patterns and inputs are generated.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"

namespace bsattn::tools {

// A workload description that cannot be built (bad sizes, contradictory options): a usage error.
class SpecError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The token mask of SPEC §4 as the tools know it: the built-in terms, with documents cut from
// each sequence as consecutive runs of `document_lengths` (cycling through the list).
struct MaskOptions : MaskSpec {
  std::vector<int> document_lengths;

  bool any() const { return MaskSpec::any() || !document_lengths.empty(); }
};

// A block picked by hand: applies to every (batch entry, sparsity head).
struct ExplicitBlock {
  int q_block = 0;
  int kv_block = 0;
  bool full = false;
};

// How each row (b, hs, qb) of the block pattern is chosen. The parts add up.
struct PatternOptions {
  // Select every block the mask touches: full where the mask keeps it whole, partial on its edge.
  bool mask_blocks = true;
  // Extra blocks per row, chosen at random: round(random_density * nKB) of the blocks not yet
  // selected (under a causal mask only blocks wholly at or below the diagonal are candidates).
  double random_density = 0.0;
  bool random_full = false;  // extra random blocks are full (attended whole) instead of partial
  std::vector<ExplicitBlock> blocks;
};

struct WorkloadSpec {
  int batch = 1;
  int heads_q = 8;
  int heads_kv = 2;
  int head_dim = 128;
  // One length per batch entry. Batched layout: all equal.
  std::vector<int> seqlens_q{4096};
  std::vector<int> seqlens_kv{4096};
  QLayout q_layout = QLayout::batched;
  KVLayout kv_layout = KVLayout::contiguous;
  int page_size = 16;

  DType dtype = DType::bf16;
  DType out_dtype = DType::bf16;
  BlockSize block{64, 64};
  Format format = Format::block_lists;
  int sparsity_heads = 1;
  MaskOptions mask;
  PatternOptions pattern;
  Proxy proxy = Proxy::off;  // off or eligible
  float scale = 0.0f;
  std::uint64_t seed = 0;

  int max_seqlen_q() const;
  int max_seqlen_kv() const;
  // The same tensors attended densely: every block, no mask, no proxy.
  WorkloadSpec dense() const;
  std::string describe() const;  // one line: sizes, layout, dtype, block, format, mask
};

// Kept (q, kv) pairs and kept blocks, over all batch entries and query heads.
struct Density {
  double pairs = 0.0;   // kept pairs / all pairs
  double blocks = 0.0;  // selected blocks / all blocks
  std::int64_t kept_pairs = 0, total_pairs = 0;
  std::int64_t kept_blocks = 0, total_blocks = 0;
};

struct VerifyResult {
  int rows = 0;  // sampled (b, h, q) rows
  double max_abs_err = 0.0;
  double rel_l2_err = 0.0;
  double max_lse_err = 0.0;
  double max_abs_err_tolerance = 0.0;
  double rel_l2_err_tolerance = 0.0;
  double lse_tolerance = 0.0;
  bool passed() const;
};

// Tolerances for outputs of `dtype` with fp32 accumulation.
VerifyResult tolerances_for(DType out_dtype);

// Element i (row-major) of a float host tensor (f32, f16 or bf16), as float.
float element_as_float(const TensorView& tensor, std::int64_t i);

// Owns the host tensors of one workload; inputs() / outputs() view them.
class Workload {
 public:
  explicit Workload(const WorkloadSpec& spec);  // throws SpecError
  ~Workload();
  Workload(Workload&&) noexcept;
  Workload& operator=(Workload&&) noexcept;

  const WorkloadSpec& spec() const;
  Problem problem(Device device = Device::cpu, int threads = 0) const;
  const Inputs& inputs() const;
  const Outputs& outputs() const;
  Density density() const;
  // Compares outputs() with a float64 reference on `rows` sampled (b, h, q) rows (the first and
  // last query of every sequence included).
  VerifyResult verify(int rows, std::uint64_t seed) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace bsattn::tools
