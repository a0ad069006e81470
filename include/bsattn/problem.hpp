// What is computed: sizes, layouts, sparsity format, mask and proxy options (SPEC §1–§6).
// A Problem holds shapes and options only; metadata values arrive with the tensors at run time.
#pragma once
#include <cstdint>

#include "bsattn/tensor.hpp"

namespace bsattn {

enum class QLayout : std::uint8_t {
  batched,  // Q [B, Sq, Hq, D]
  varlen,   // Q [total_q, Hq, D] with cu_seqlens_q [B+1]
};

enum class KVLayout : std::uint8_t {
  contiguous,  // K/V [B, Skv, Hkv, D], or [total_kv, Hkv, D] when Q is varlen (cu_seqlens_k)
  paged,       // k_cache/v_cache [num_pages, page_size, Hkv, D], block_table [B, C], seq_lens_kv [B]
};

enum class Format : std::uint8_t {
  all_blocks,          // no sparsity tensors: every KV block is a partial block (dense + mask)
  block_lists,         // cnt [Bs, Hs, nQB], idx [Bs, Hs, nQB, L]
  varlen_block_lists,  // cnt [Hs, total_m_blocks], idx [Hs, total_n_blocks] + cu_total_m_blocks, cu_block_idx_offsets
  bsr,                 // indptr [R+1], indices [nnz]; rows in the order of the block-list counts
  bitmask,             // uint32 words [Bs, Hs, nQB, W] (varlen: [Hs, total_m_blocks, W])
};

// Where the diagonal of causal and window masks sits when Sq != Skv.
enum class Alignment : std::uint8_t {
  bottom_right,  // diag(q) = q + Skv - Sq (FlashAttention's convention, the default)
  top_left,      // diag(q) = q
};

enum class Proxy : std::uint8_t {
  off,
  eligible,      // every unselected block the mask keeps whole contributes one summary term (SPEC §6)
  explicit_set,  // the `proxy` block set names the blocks that contribute (selected ones are skipped)
};

const char* to_string(Format format);  // "block_lists", ...
const char* to_string(Proxy proxy);    // "off", "eligible", "explicit_set"

struct BlockSize {
  int q = 128;   // Bq: 16, 32 or a multiple of 64
  int kv = 128;  // Bk: a multiple of 16
};

// Built-in token mask (SPEC §4). All terms combine by AND; sink tokens relax the window only:
//   visible = causal_ok && (in_window || kv < sink_tokens) && same_document && kv_valid
// with causal_ok = kv <= diag(q) and in_window = diag(q) - window_left <= kv <= diag(q) + window_right.
struct MaskSpec {
  bool causal = false;
  Alignment alignment = Alignment::bottom_right;
  int window_left = -1;   // -1: unlimited; else kv >= diag - window_left
  int window_right = -1;  // -1: unlimited; else kv <= diag + window_right
  int sink_tokens = 0;
  bool document_ids = false;  // doc_q / doc_kv tensors given
  bool kv_valid_bits = false;  // kv_valid [B, ceil(Skv/32)] given

  bool any() const {
    return causal || window_left >= 0 || window_right >= 0 || document_ids || kv_valid_bits;
  }
};

struct Problem {
  int batch = 1;
  int heads_q = 1;
  int heads_kv = 1;
  int head_dim = 128;
  // Batched: the sequence lengths. Varlen / paged: upper bounds (they size the route workspace,
  // the block-list extents and the summaries).
  int max_seqlen_q = 0;
  int max_seqlen_kv = 0;

  QLayout q_layout = QLayout::batched;
  KVLayout kv_layout = KVLayout::contiguous;
  std::int64_t total_q = 0;   // varlen: rows of the packed Q tensor
  std::int64_t total_kv = 0;  // varlen contiguous KV: rows of the packed K/V tensors
  int page_size = 0;          // paged
  int num_pages = 0;          // paged
  int pages_per_seq = 0;      // paged: C, the number of block_table columns that may be read

  DType dtype = DType::bf16;      // Q, K, V (and summaries)
  DType out_dtype = DType::bf16;  // O; LSE is always f32

  BlockSize block;
  Format format = Format::block_lists;
  int sparsity_heads = 1;  // Hs: 1, Hkv or Hq
  int sparsity_batch = 1;  // Bs: 1 (broadcast) or B; block lists and bitmask only
  bool has_partial = true;
  bool has_full = false;
  MaskSpec mask;
  Proxy proxy = Proxy::off;
  float scale = 0.0f;  // 0: 1/sqrt(head_dim)

  Device device = Device::cpu;
  int device_index = 0;
  // Per-row route capacity; 0 sizes it so that no input can overflow it.
  int max_routes_per_row = 0;
  // Tile overrides (0: chosen from the block size, SPEC §8). tile_m must be a multiple of 16
  // that divides Bq or that Bq divides; tile_n must divide Bk and be a multiple of 16.
  int tile_m = 0;
  int tile_n = 0;
  int num_threads = 0;  // CPU engine; 0: hardware concurrency
  // Value checks (indices, counts, cu_*, page ids). Structural checks always run.
  bool validate = true;
  // Plan for the backward too: on the GPU, plan() then sizes the backward's workspace (an fp32 dQ
  // accumulator of 4 bytes per element of Q, twice the routes), which a forward-only plan does
  // not pay for; run_backward() on a GPU plan without it is refused (problem.backward). The CPU
  // engine needs nothing extra and ignores it.
  bool backward = false;
  // GPU backward: dQ contributions are added in a fixed order, so repeated runs are bit-identical
  // (slower: CTAs wait for each other's turn). The CPU engine is always deterministic.
  bool deterministic = false;
};

// One set of blocks (partial, full or proxy) in the problem's format. Only the fields of that
// format are read.
struct BlockSet {
  TensorView counts;   // block lists: cnt
  TensorView indices;  // block lists: idx; bsr: indices
  TensorView indptr;   // bsr
  TensorView bits;     // bitmask words (uint32)
  bool defined() const { return counts.defined() || indices.defined() || indptr.defined() || bits.defined(); }
};

struct Inputs {
  TensorView q, k, v;  // k, v are the page caches when the KV layout is paged
  TensorView cu_seqlens_q, cu_seqlens_k, seqused_k;  // varlen (int32)
  TensorView block_table, seq_lens_kv;               // paged (int32)
  BlockSet partial, full, proxy;
  TensorView cu_total_m_blocks, cu_block_idx_offsets;  // varlen block lists / varlen bitmask
  TensorView doc_q, doc_kv;  // int32 per token: batched [B, S]; varlen [total]; paged doc_kv [B, C*page_size]
  TensorView kv_valid;       // uint32 [B, ceil(max_seqlen_kv / 32)]
  TensorView k_summary, v_summary;  // [B, ceil(max_seqlen_kv / Bk), Hkv, D]
};

struct Outputs {
  TensorView out;  // Q's layout, out_dtype
  TensorView lse;  // f32: batched [B, Hq, Sq]; varlen [Hq, total_q]; may be left undefined
};

}  // namespace bsattn
