// Merging partial attention results by their log-sum-exp (split-KV decode, cascade attention,
// context parallelism): attention over disjoint KV subsets, each returned with its LSE, combines
// into attention over their union.
//
// The tensors are those attention() writes: O batched [B, S, H, D] or varlen [total, H, D]
// (f32, f16 or bf16; any non-negative strides with a contiguous last dimension), LSE f32 batched
// [B, H, S] or varlen [H, total] (natural log; any strides). Per (row, head), in fp32:
//   m   = max_i lse_i,   w_i = exp(lse_i - m),   s = sum_i w_i
//   out = sum_i w_i * o_i / s,   lse = m + log(s)
// and the result is rounded once to O's dtype.
//   * A part with lse_i = -inf (an empty row) has weight 0 and its O is ignored (it may hold
//     anything); a row where every part is empty gives O = 0, LSE = -inf.
//   * A NaN LSE in any part makes the row's O and LSE NaN (so does lse_i = +inf, which no
//     attention result holds); NaN in the O of a part with nonzero weight reaches the output.
//
// Aliasing: the output may be exactly one of the parts (the same address and strides), e.g. to
// fold results in place with merge_state(acc, acc_lse, part, part_lse, acc, acc_lse); the same
// holds for the output LSE. Any other overlap of an output with an input, or of out with lse, is
// rejected.
//
// The device comes from the tensors (all on the same one): Device::cpu merges on the calling
// thread (large merges use a pool of worker threads) and returns when done; Device::cuda launches
// one kernel on `stream` and returns (no host synchronisation, no allocation). Malformed
// arguments throw bsattn::Error naming the argument before anything is written.
#pragma once
#include "bsattn/plan.hpp"

namespace bsattn {

// Two partial results -> one. out_a, out_b and out have one shape and dtype; lse_a, lse_b and lse
// the matching LSE shape. `lse` may be left undefined when only O is wanted.
void merge_state(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b, const TensorView& lse_b,
                 const TensorView& out, const TensorView& lse, Stream stream = nullptr);

// N >= 1 partial results stacked on a leading dimension: outs [N, B, S, H, D] or [N, total, H, D],
// lses [N, B, H, S] or [N, H, total] -> out (a part's shape and dtype) and lse (optional).
void merge_states(const TensorView& outs, const TensorView& lses, const TensorView& out, const TensorView& lse,
                  Stream stream = nullptr);

}  // namespace bsattn
