// Flat, pointer-and-stride parameters shared by route preparation and every attention engine.
// Plain data only, so the same struct is passed by value to CUDA kernels.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BSATTN_HD __host__ __device__ __forceinline__
#else
#define BSATTN_HD inline
#endif

namespace bsattn::route {

enum class SetFormat : std::uint8_t { all_blocks, block_lists, varlen_block_lists, bsr, bitmask };

// One block set (partial, full or proxy); unused pointers are null.
struct BlockSetParams {
  const std::int32_t* counts = nullptr;  // lists
  const std::int32_t* indices = nullptr;  // lists, bsr
  const std::int32_t* indptr = nullptr;   // bsr
  const std::uint32_t* bits = nullptr;    // bitmask
  // Batched lists / bitmask: strides over (bs, hs, qb, i|w). Varlen: (hs, row, i|w) in [1..3].
  std::int64_t count_stride[3] = {0, 0, 0};
  std::int64_t index_stride[4] = {0, 0, 0, 0};
  std::int64_t bits_stride[4] = {0, 0, 0, 0};
  int list_length = 0;  // block lists: L, the row length (a count above it is clamped); 0 elsewhere
  bool present() const { return counts || indptr || bits; }
};

struct RouteParams {
  // Geometry.
  int batch = 1;
  int heads_q = 1, heads_kv = 1, sparsity_heads = 1, sparsity_batch = 1;
  int block_q = 128, block_kv = 128;
  int tile_m = 128, tile_n = 128;
  int unit_m = 128;  // rows per Q unit: min(block_q, tile_m); a tile holds tile_m / unit_m units
  int max_seqlen_q = 0, max_seqlen_kv = 0;
  int max_q_tiles = 0;  // ceil(max_seqlen_q / tile_m): route rows per (b, hs)
  int max_q_blocks = 0;  // ceil(max_seqlen_q / block_q): batched block-list extent
  int max_kv_blocks = 0;

  // Sequence lengths.
  bool varlen_q = false;
  bool varlen_kv = false;  // contiguous packed KV (cu_seqlens_k)
  bool paged = false;
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  const std::int32_t* seqused_k = nullptr;
  const std::int32_t* seq_lens_kv = nullptr;  // paged
  const std::int32_t* cu_total_m_blocks = nullptr;
  const std::int32_t* cu_block_idx_offsets = nullptr;

  // Sparsity.
  SetFormat format = SetFormat::block_lists;
  BlockSetParams partial, full, proxy;
  bool has_partial = true;  // all_blocks format: every block is partial
  bool has_full = false;
  int proxy_mode = 0;  // 0 off, 1 eligible, 2 explicit set

  // Built-in mask.
  bool causal = false;
  bool top_left = false;  // diagonal alignment; bottom-right otherwise
  int window_left = -1, window_right = -1;
  int sink_tokens = 0;
  const std::int32_t* doc_q = nullptr;   // per token, addressed through the Q token base
  const std::int32_t* doc_kv = nullptr;  // per token, addressed through the KV token base
  std::int64_t doc_q_batch_stride = 0, doc_kv_batch_stride = 0;
  const std::uint32_t* kv_valid = nullptr;
  std::int64_t kv_valid_batch_stride = 0;
  bool custom_mask = false;  // a user functor ANDs in: no block may be upgraded to full

  // Route stream: row r = (b * Hs + hs) * max_q_tiles + q_tile.
  int capacity = 0;  // records per row
  // GPU runs with validate = true: the device value checks' flag word (gpu/check_values.hpp);
  // while it is raised, route preparation reads no metadata and prepares no row.
  const std::int32_t* values_invalid = nullptr;
};

// Per-sequence lengths and token bases.
struct SeqInfo {
  int seqlen_q = 0, seqlen_kv = 0;
  std::int64_t q_base = 0;   // first row of this sequence in the packed Q (varlen) or b * Sq
  std::int64_t kv_base = 0;  // first row in packed K/V (varlen), b * Skv (batched); 0 when paged
  int q_blocks = 0, kv_blocks = 0;
  int m_block_base = 0;    // varlen lists: cu_total_m_blocks[b]
  std::int64_t idx_base = 0;  // varlen lists: cu_block_idx_offsets[b]
  int diag_offset = 0;     // added to q to reach the aligned diagonal (causal / window)
};

BSATTN_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

BSATTN_HD SeqInfo seq_info(const RouteParams& p, int b) {
  SeqInfo s;
  if (p.varlen_q) {
    s.q_base = p.cu_seqlens_q[b];
    s.seqlen_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
  } else {
    s.q_base = static_cast<std::int64_t>(b) * p.max_seqlen_q;
    s.seqlen_q = p.max_seqlen_q;
  }
  if (p.paged) {
    s.kv_base = 0;
    s.seqlen_kv = p.seq_lens_kv[b];
  } else if (p.varlen_kv) {
    s.kv_base = p.cu_seqlens_k[b];
    s.seqlen_kv = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  } else {
    s.kv_base = static_cast<std::int64_t>(b) * p.max_seqlen_kv;
    s.seqlen_kv = p.max_seqlen_kv;
  }
  s.q_blocks = ceil_div(s.seqlen_q, p.block_q);
  s.kv_blocks = ceil_div(s.seqlen_kv, p.block_kv);
  if (p.cu_total_m_blocks) s.m_block_base = p.cu_total_m_blocks[b];
  if (p.cu_block_idx_offsets) s.idx_base = p.cu_block_idx_offsets[b];
  s.diag_offset = p.top_left ? 0 : s.seqlen_kv - s.seqlen_q;
  return s;
}

// Varlen block-list offsets (SPEC §3.2) from the sequence lengths: [B+1] prefix sums of nQB(b)
// and nQB(b) * nKB(b). Serial over b: B is small next to everything else.
BSATTN_HD void varlen_block_offsets(RouteParams p, std::int32_t* cu_total_m_blocks, std::int32_t* cu_block_idx_offsets) {
  p.cu_total_m_blocks = nullptr;
  p.cu_block_idx_offsets = nullptr;
  cu_total_m_blocks[0] = 0;
  cu_block_idx_offsets[0] = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    cu_total_m_blocks[b + 1] = cu_total_m_blocks[b] + s.q_blocks;
    cu_block_idx_offsets[b + 1] = cu_block_idx_offsets[b] + s.q_blocks * s.kv_blocks;
  }
}

}  // namespace bsattn::route
