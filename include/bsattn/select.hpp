// Block selection (SPEC §7): per row (b, hs, qb), the KV blocks to attend exactly, chosen from the
// mean-pooled Q block and the K summaries, written as the bitmask of SPEC §3.4 that attention()
// takes as is. The CPU engine and the GPU kernel give the same bits (docs/ARCHITECTURE.md,
// "Block selection").
#pragma once
#include <cstdint>

#include "bsattn/plan.hpp"

namespace bsattn {

enum class SelectPolicy : std::uint8_t {
  top_k,  // the top_k best-scoring visible blocks, forced ones included in the count
  tau,    // blocks scoring >= mean + tau * std of the row's visible scores, plus the forced ones
  mass,   // the smallest best-first set whose softmax mass over the visible blocks reaches `mass`, plus forced
};

enum class SelectHeads : std::uint8_t {
  query,  // a row per query head: sparsity_heads = heads_q
  kv,     // a row per KV head, scored with the sum of its query heads' scores: sparsity_heads = heads_kv
};

struct SelectOptions {
  SelectPolicy policy = SelectPolicy::top_k;
  int top_k = 1;      // top_k: at least 1
  float tau = 0.0f;   // tau: finite
  float mass = 1.0f;  // mass: in (0, 1]
  // Forced blocks (always selected when visible).
  int sinks = 0;          // the first `sinks` KV blocks
  int local = 0;          // the `local` blocks on each side of the diagonal block
  bool diagonal = true;   // the diagonal block: the KV block holding the aligned diagonal of the Q
                          // block's last in-range row (clamped to the sequence's blocks)
  bool causal = false;    // no block entirely above that diagonal is visible (nor selected)
  Alignment alignment = Alignment::bottom_right;  // of the diagonal, as MaskSpec::alignment
  SelectHeads heads = SelectHeads::query;
};

// The sparsity heads of the bitmask select_blocks() writes: heads_q or heads_kv.
int select_sparsity_heads(const Problem& problem, const SelectOptions& options);

// Reads inputs.q (problem's Q layout and dtype), inputs.k_summary [B, ceil(max_seqlen_kv / Bk),
// Hkv, D] in problem.dtype (build_summaries() writes it) and the sequence lengths of problem's
// layout (cu_seqlens_q; cu_seqlens_k / seqused_k, or seq_lens_kv when paged; values checked when
// problem.validate); other inputs are not read. Scores of a row: scale * <pooled Q, k_summary[j]>
// with the pooled Q the mean over the Q block's in-range tokens (summed over the query heads of the
// KV head with SelectHeads::kv). Writes every word of `bits` (uint32): batched [B, Hs, nQB, W],
// varlen [Hs, M, W] with M >= total_m_blocks (rows past it are zero), W >= ceil(nKB / 32); bits at
// or beyond a sequence's nKB(b) are zero. Use it with Format::bitmask, sparsity_heads =
// select_sparsity_heads() and, batched, sparsity_batch = B. On the GPU it only launches on
// `stream` (no host sync, no allocation, unless problem.validate reads metadata values).
// Throws bsattn::Error naming the argument before writing anything.
void select_blocks(const Problem& problem, const Inputs& inputs, const SelectOptions& options, const TensorView& bits,
                   Stream stream = nullptr);

}  // namespace bsattn
