// The flat parameter struct a backward engine receives: the forward's AttentionParams (Q, K, V,
// the route stream, and O and LSE, which the backward reads) plus dO and the three gradients.
// Plain data, like AttentionParams, so a GPU backward can take it by value.
#pragma once
#include <cstdint>

#include "bsattn/attention_params.hpp"

namespace bsattn {

// Element strides of a tensor laid out like Q ([B, S, H, D] or varlen [total, H, D]) or like K/V.
struct TokenStrides {
  std::int64_t batch = 0, token = 0, head = 0;
};

struct BackwardParams {
  AttentionParams fwd;  // fwd.out is O and fwd.lse is LSE: inputs here, never written

  const void* dout = nullptr;  // O's layout and dtype (fwd.out_type)
  TokenStrides dout_strides;
  const float* dlse = nullptr;  // optional dL/dLSE, LSE's layout
  std::int64_t dlse_batch_stride = 0, dlse_head_stride = 0, dlse_token_stride = 0;
  void* dq = nullptr;  // Q's layout
  TokenStrides dq_strides;
  ElementType dq_type = ElementType::f32;
  void* dk = nullptr;  // K's layout
  TokenStrides dk_strides;
  ElementType dk_type = ElementType::f32;
  void* dv = nullptr;  // V's layout
  TokenStrides dv_strides;
  ElementType dv_type = ElementType::f32;

  // Offset of row q (sequence-local) of head h in a tensor laid out like Q.
  BSATTN_HD std::int64_t q_like_offset(const TokenStrides& t, int b, const route::SeqInfo& s, int q, int h) const {
    return fwd.route.varlen_q ? (s.q_base + q) * t.token + h * t.head : b * t.batch + q * t.token + h * t.head;
  }
  BSATTN_HD std::int64_t dlse_offset(int b, const route::SeqInfo& s, int q, int h) const {
    return fwd.route.varlen_q ? h * dlse_head_stride + (s.q_base + q) * dlse_token_stride
                              : b * dlse_batch_stride + h * dlse_head_stride + q * dlse_token_stride;
  }
  // Offset of token kv of head hkv in a tensor laid out like (contiguous or packed) K/V.
  BSATTN_HD std::int64_t kv_like_offset(const TokenStrides& t, int b, const route::SeqInfo& s, int kv, int hkv) const {
    return fwd.kv_offset(b, s, kv, hkv, t.batch, t.token, t.head);
  }
};

}  // namespace bsattn
