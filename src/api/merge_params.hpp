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

// The merge of one (row, head), one part at a time in a single pass (an online softmax over the
// parts' LSEs), so that a part's LSE and O can be loaded together:
//   float weight;
//   const float rescale = acc.add(lse_i, weight);
//   o_acc = o_acc * rescale (when rescale != 1) + weight * o_i (when weight != 0);
// and at the end out = o_acc * acc.inv_sum(), lse = acc.lse(). An empty part (lse_i = -inf) has
// weight 0 and changes nothing, so its O is never used; a NaN LSE (or +inf) turns the sum, the
// accumulator and the LSE into NaN.
struct Accumulator {
  // exp of a difference of LSEs (<= 0, or NaN): the fast hardware exponential on the device
  // unless kExact (merge_states, whose results are held to the CPU loop's within 2e-6).
  template <bool kExact = false>
  static BSATTN_HD float exp_of(float x) {
#ifdef __CUDA_ARCH__
    if constexpr (!kExact) return __expf(x);
#endif
    return expf(x);
  }
  // The exponent base of a maximum: 0 while every part is empty, so that weights are exp(-inf) = 0.
  static BSATTN_HD float base(float max) { return max == -INFINITY ? 0.0f : max; }
  float max_lse = -INFINITY;
  float sum = 0.0f;  // sum_i exp(lse_i - max_lse) over the parts added so far

  // Returns the factor the O accumulator must be scaled by before adding weight * o_i.
  BSATTN_HD float add(float part_lse, float& weight) {
    weight = 0.0f;
    if (part_lse == -INFINITY) return 1.0f;
    float rescale = 1.0f;
    // A NaN is taken as the new maximum and then kept: no comparison with it is true.
    if (part_lse > max_lse || part_lse != part_lse) {
      rescale = expf(max_lse - part_lse);  // 0 for the first non-empty part
      sum *= rescale;
      max_lse = part_lse;
    }
    weight = expf(part_lse - max_lse);
    sum += weight;
    return rescale;
  }
  // add() in pieces, for parts whose LSEs are at hand together (the decode kernel's split merge
  // reduces a batch of them across a warp): the batch's maximum by max_of (a NaN is kept), then
  // rebase() to the new maximum (returns the O accumulator's factor), then each part's weight()
  // is added to `sum` and weight * o_i to the O accumulator (none for an empty part: weight 0).
  static BSATTN_HD float max_of(float a, float b) { return (b > a || b != b) ? b : a; }
  template <bool kExact = false>
  BSATTN_HD float rebase(float new_max) {
    const float rescale = exp_of<kExact>(max_lse - base(new_max));  // 0 from an empty start
    sum *= rescale;
    max_lse = new_max;
    return rescale;
  }
  template <bool kExact = false>
  BSATTN_HD float weight(float part_lse) const { return exp_of<kExact>(part_lse - base(max_lse)); }
  BSATTN_HD float inv_sum() const { return sum == 0.0f ? 0.0f : 1.0f / sum; }  // 0 for an empty row
  BSATTN_HD float lse() const { return sum == 0.0f ? -INFINITY : max_lse + logf(sum); }
};

}  // namespace bsattn::merge
