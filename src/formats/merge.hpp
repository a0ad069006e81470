// Validation and binding of merge_state / merge_states arguments (bsattn/merge.hpp).
#pragma once
#include <vector>

#include "api/merge_params.hpp"
#include "bsattn/tensor.hpp"

namespace bsattn::formats {

// One partial result as the caller named it: an O tensor and its LSE.
struct MergePart {
  const char* out_name;
  const TensorView* out;
  const char* lse_name;
  const TensorView* lse;
};

// `parts`: the two results of merge_state, or the one stacked pair [N, ...] of merge_states
// (`stacked`). Every part and `out` agree in shape, float dtype and device; the LSEs are f32 of
// the shape their O implies; `lse` is optional. An output may overlap an input only by being one
// of the parts exactly (same address, shape and strides). Throws bsattn::Error naming the argument.
void validate_merge(const std::vector<MergePart>& parts, bool stacked, const TensorView& out, const TensorView& lse);

// Addresses and element strides of validated arguments.
merge::MergeParams bind_merge(const std::vector<MergePart>& parts, bool stacked, const TensorView& out,
                              const TensorView& lse);

}  // namespace bsattn::formats
