// What a merge (bsattn/merge.hpp) hands its engines: flat pointers and element strides, passed by
// value to the CUDA kernel, plus the per-(row, head) weight arithmetic that the CPU loop and the
// kernel share, so both follow one set of -inf / NaN rules.
#pragma once
#include <math.h>

#include <cstdint>

#include "bsattn/attention_params.hpp"

namespace bsattn::merge {

// One O tensor and its LSE, addressed like attention()'s outputs: O batched [B, S, H, D] or
// varlen [total, H, D] (batch strides 0), LSE [B, H, S] or [H, total]. `lse` may be null for the
// output.
struct Layout {
  void* out = nullptr;
  std::int64_t out_batch_stride = 0, out_token_stride = 0, out_head_stride = 0;
  float* lse = nullptr;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_token_stride = 0;

  BSATTN_HD std::int64_t out_offset(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return b * out_batch_stride + s * out_token_stride + h * out_head_stride;
  }
  BSATTN_HD std::int64_t lse_offset(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return b * lse_batch_stride + h * lse_head_stride + s * lse_token_stride;
  }
};

struct MergeParams {
  ElementType type = ElementType::bf16;  // every part's O and the output O
  int parts = 0;
  int head_dim = 0;
  std::int64_t batch = 0, tokens = 0, heads = 0;  // varlen: batch 1, tokens = total

  // Part i is `first` (i = 0) or `second` (i >= 1), moved by i part steps (elements):
  // merge_state gives two layouts and no step, merge_states one layout twice and the stride of
  // the stacked dimension.
  Layout first, second;
  std::int64_t out_part_step = 0, lse_part_step = 0;
  Layout result;

  BSATTN_HD std::int64_t items() const { return batch * tokens * heads; }
  BSATTN_HD const Layout& part(int i) const { return i == 0 ? first : second; }
  BSATTN_HD std::int64_t part_out_offset(int i, std::int64_t b, std::int64_t s, std::int64_t h) const {
    return i * out_part_step + part(i).out_offset(b, s, h);
  }
  BSATTN_HD float part_lse(int i, std::int64_t b, std::int64_t s, std::int64_t h) const {
    return part(i).lse[i * lse_part_step + part(i).lse_offset(b, s, h)];
  }
};

// The merge of one (row, head): part i enters O with weight(lse_i).
struct Weights {
  float shift = 0.0f;    // max_i lse_i (0 when every part is empty); NaN when any lse_i is NaN
  float inv_sum = 0.0f;  // 1 / sum_i exp(lse_i - shift); 0 when every part is empty
  float lse = 0.0f;      // shift + log(sum): -inf when every part is empty

  // exp(lse_i - max) / sum: 0 for an empty part (lse_i = -inf) and for every part of an empty
  // row; NaN when the row holds a NaN LSE. A part of weight 0 need not be read.
  BSATTN_HD float weight(float part_lse) const { return expf(part_lse - shift) * inv_sum; }
};

// `lse_of(i)` gives part i's LSE for i in [0, parts).
template <class LseOf>
BSATTN_HD Weights merge_weights(int parts, const LseOf& lse_of) {
  float max_lse = -INFINITY;
  for (int i = 0; i < parts; ++i) {
    const float x = lse_of(i);
    // A NaN is taken and then kept: no comparison with it is true (fmaxf would drop it).
    if (x > max_lse || x != x) max_lse = x;
  }
  Weights w;
  w.shift = max_lse == -INFINITY ? 0.0f : max_lse;  // all empty: every exp(-inf - 0) is 0
  float sum = 0.0f;
  for (int i = 0; i < parts; ++i) sum += expf(lse_of(i) - w.shift);
  w.inv_sum = sum == 0.0f ? 0.0f : 1.0f / sum;  // NaN stays NaN
  w.lse = sum == 0.0f ? -INFINITY : w.shift + logf(sum);
  return w;
}

}  // namespace bsattn::merge
