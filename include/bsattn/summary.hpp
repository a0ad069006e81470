// The proxy summary builder (SPEC §6): per KV block j of each sequence and KV head,
//   k_summary[b, j, h, :] = mean of K over the block's in-range tokens,
//   v_summary[b, j, h, :] = sum of V over them,
// accumulated in fp32 and rounded once to the K/V dtype. Blocks past a sequence's end are zero.
#pragma once
#include "bsattn/plan.hpp"

namespace bsattn {

// Reads inputs.k / inputs.v and the sequence-length metadata of `problem`'s layout
// (cu_seqlens_q and cu_seqlens_k / seqused_k when varlen; block_table and seq_lens_kv when
// paged), checked like attention()'s (values when problem.validate); writes k_summary and
// v_summary, each [B, ceil(max_seqlen_kv / Bk), Hkv, D] in problem.dtype.
// problem.device picks the engine: Device::cpu computes on the calling thread's pool and returns
// when done; Device::cuda (f32, f16 or bf16, any D and page size the problem allows) only
// launches one kernel on `stream`: no allocation, and no host sync unless problem.validate
// (whose value checks copy the length metadata to the host after a device sync).
void build_summaries(const Problem& problem, const Inputs& inputs, const TensorView& k_summary,
                     const TensorView& v_summary, Stream stream = nullptr);

}  // namespace bsattn
