// Proxy summaries on the GPU (SPEC §6): the kernel behind build_summaries() for device tensors.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "bsattn/attention_params.hpp"

namespace bsattn::gpu {

// The two outputs, [B, nKB, Hkv, D] in the K/V element type; strides in elements.
struct SummaryOutputs {
  void* k = nullptr;  // mean of K over each block's in-range tokens
  void* v = nullptr;  // sum of V over them
  std::int64_t k_batch_stride = 0, k_block_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_block_stride = 0, v_head_stride = 0;
  int kv_blocks = 0;  // nKB = ceil(max_seqlen_kv / Bk)
};

// Reads K and V once through params' addressing (contiguous, varlen or paged; lengths from
// params.route) and writes both summaries of every (batch, KV block, KV head); blocks past a
// sequence's end get zeros. Only launches on `stream`: no allocation, no host sync.
cudaError_t build_summaries(const AttentionParams& params, const SummaryOutputs& outputs, cudaStream_t stream);

}  // namespace bsattn::gpu
