// Varlen block-list metadata (SPEC §3.2) from the sequence lengths, without a host sync:
//   cu_total_m_blocks[b+1]    = cu_total_m_blocks[b]    + nQB(b)
//   cu_block_idx_offsets[b+1] = cu_block_idx_offsets[b] + nQB(b) * nKB(b)
// with nQB(b) = ceil(Sq_b / Bq), nKB(b) = ceil(Skv_b / Bk) and Skv_b from seqused_k when given.
#pragma once
#include "bsattn/plan.hpp"

namespace bsattn {

// Reads inputs.cu_seqlens_q and the KV lengths of problem's layout (cu_seqlens_k / seqused_k, or
// seq_lens_kv when paged); writes both int32 [B+1] tensors. On a CUDA device it only launches
// on `stream`. A Plan derives these itself when they are not given; this is for callers that
// build varlen block lists on the device.
void varlen_block_offsets(const Problem& problem, const Inputs& inputs, const TensorView& cu_total_m_blocks,
                          const TensorView& cu_block_idx_offsets, Stream stream = nullptr);

}  // namespace bsattn
