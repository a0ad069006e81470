// Attention that picks its own blocks (issue 11.4, SPEC §6-§8): build_summaries() ->
// select_blocks() -> Plan::run() enqueued by one call on one stream. On the GPU, with
// problem.validate = false, run() makes no host sync and no allocation, so it can be captured in a
// CUDA graph and replayed with new Q/K/V values at the same addresses: the replay selects again
// from the new values.
#pragma once
#include <cstddef>
#include <memory>

#include "bsattn/plan.hpp"
#include "bsattn/select.hpp"

namespace bsattn {

class SelectedAttention {
 public:
  // `problem` gives sizes, layouts, dtypes, block size, token mask, scale, device and validate;
  // its sparsity description (format, sparsity_heads, sparsity_batch, has_partial, has_full) is
  // ignored: the object attends the bitmask select_blocks() writes (Format::bitmask, partial
  // blocks, sparsity heads from options.heads, per batch entry when batched).
  // problem.proxy is the proxy switch: Proxy::off, or Proxy::eligible to add the summary term of
  // every unselected block the mask keeps whole (SPEC §6); explicit_set is refused.
  // Allocates, once, the summaries [B, nKB, Hkv, D] (problem.dtype), the bitmask (batched
  // [B, Hs, nQB, W], varlen [Hs, M, W] with M the bound on total_m_blocks that the sizes imply)
  // and the attention Plan. Throws bsattn::Error naming the field (the Plan's own errors
  // included, e.g. problem.proxy where this build has no GPU proxy kernel for the problem).
  SelectedAttention(const Problem& problem, const SelectOptions& options);
  ~SelectedAttention();
  SelectedAttention(SelectedAttention&&) noexcept;
  SelectedAttention& operator=(SelectedAttention&&) noexcept;
  SelectedAttention(const SelectedAttention&) = delete;
  SelectedAttention& operator=(const SelectedAttention&) = delete;

  // Reads q, k, v and the layout's sequence lengths, plus the mask tensors (doc_q / doc_kv /
  // kv_valid) the problem names; the sparsity sets, cu_total_m_blocks / cu_block_idx_offsets and
  // the summaries must be left empty (the object owns them). Writes the summaries, the bitmask,
  // then outputs.out (and outputs.lse when given), each step on `stream`. Errors are thrown
  // before outputs are written. GPU: no allocation; no host sync unless problem.validate.
  void run(const Inputs& inputs, const Outputs& outputs, Stream stream = nullptr);
  // Plan::check() of the attention plan (route capacity; nothing to do with the default capacity).
  void check(Stream stream = nullptr);

  const Problem& problem() const;  // the attention problem: Format::bitmask, the sparsity heads
  const SelectOptions& options() const;
  const Plan& plan() const;
  // The owned buffers the latest run() wrote (device memory on the GPU).
  const TensorView& k_summary() const;
  const TensorView& v_summary() const;
  const TensorView& bits() const;
  // Summaries and bitmask plus the plan's workspace.
  std::size_t workspace_bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace bsattn
