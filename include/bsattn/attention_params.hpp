// The flat parameter struct an attention engine receives: route parameters plus tensor
// addresses and strides (elements). Plain data, passed by value to CUDA kernels.
#pragma once
#include <cstdint>

#include "bsattn/route/params.hpp"
#include "bsattn/route/route.hpp"

namespace bsattn {

enum class ElementType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

struct AttentionParams {
  route::RouteParams route;

  int head_dim = 0;
  float scale = 1.0f;
  ElementType in_type = ElementType::bf16;
  ElementType out_type = ElementType::bf16;

  // Q and O: batched [B, S, H, D] (batch, token, head strides); varlen [total, H, D] (batch unused).
  const void* q = nullptr;
  std::int64_t q_batch_stride = 0, q_token_stride = 0, q_head_stride = 0;
  void* out = nullptr;
  std::int64_t out_batch_stride = 0, out_token_stride = 0, out_head_stride = 0;
  // LSE: batched [B, Hq, Sq]; varlen [Hq, total_q]. Null when not requested.
  float* lse = nullptr;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_token_stride = 0;

  // K and V: batched [B, Skv, Hkv, D]; varlen [total_kv, Hkv, D]; paged [pages, page_size, Hkv, D]
  // (batch stride = page stride).
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t k_batch_stride = 0, k_token_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_token_stride = 0, v_head_stride = 0;
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0;
  int page_size = 0;

  // Proxy summaries [B, nKB, Hkv, D].
  const void* k_summary = nullptr;
  const void* v_summary = nullptr;
  std::int64_t summary_batch_stride = 0, summary_block_stride = 0, summary_head_stride = 0;
  std::int64_t v_summary_batch_stride = 0, v_summary_block_stride = 0, v_summary_head_stride = 0;

  // Route stream.
  const route::Route* routes = nullptr;
  const std::int32_t* route_counts = nullptr;
  // GPU proxy kernels: proxy records per row (the last ones of the row; SPEC §6). Null elsewhere.
  const std::int32_t* route_proxy_counts = nullptr;
  int route_rows = 0;
  // GPU work order: route rows, longest first, and the counter persistent CTAs claim work from
  // (zero before each launch). The CPU engine does not use them.
  const std::int32_t* row_order = nullptr;  // null: index order (work items do not queue)
  // With row_order: how many of its rows lie in their sequences (device; null: all). The rest,
  // ordered last, are never visited (a Q tile past its sequence's end writes nothing).
  const std::int32_t* live_rows = nullptr;
  std::int32_t* work_counter = nullptr;
  // GPU: no route preparation ran; each route row's routes are every KV tile up to its last
  // visible key (route::routes_follow_lengths, prefix_tiles), made by the kernel itself.
  bool routes_from_lengths = false;

  BSATTN_HD std::int64_t q_offset(int b, const route::SeqInfo& s, int q, int h) const {
    return route.varlen_q ? (s.q_base + q) * q_token_stride + h * q_head_stride
                          : b * q_batch_stride + q * q_token_stride + h * q_head_stride;
  }
  BSATTN_HD std::int64_t out_offset(int b, const route::SeqInfo& s, int q, int h) const {
    return route.varlen_q ? (s.q_base + q) * out_token_stride + h * out_head_stride
                          : b * out_batch_stride + q * out_token_stride + h * out_head_stride;
  }
  BSATTN_HD std::int64_t lse_offset(int b, const route::SeqInfo& s, int q, int h) const {
    return route.varlen_q ? h * lse_head_stride + (s.q_base + q) * lse_token_stride
                          : b * lse_batch_stride + h * lse_head_stride + q * lse_token_stride;
  }
  // Offset of token kv of sequence b, head hkv, in a K or V tensor with the given strides.
  BSATTN_HD std::int64_t kv_offset(int b, const route::SeqInfo& s, int kv, int hkv, std::int64_t batch_stride,
                                   std::int64_t token_stride, std::int64_t head_stride) const {
    if (route.paged) {
      const std::int64_t page = block_table[b * block_table_stride + kv / page_size];
      return page * batch_stride + (kv % page_size) * token_stride + hkv * head_stride;
    }
    if (route.varlen_kv) return (s.kv_base + kv) * token_stride + hkv * head_stride;
    return b * batch_stride + kv * token_stride + hkv * head_stride;
  }
};

}  // namespace bsattn
