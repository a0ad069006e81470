// NumPy .npy output for the CLI's --save-outputs.
#pragma once
#include <string>

#include "bsattn/tensor.hpp"

namespace bsattn::tools {

// Writes a contiguous host tensor of f32, f16 or bf16 as a float32 .npy file (bf16 has no NumPy
// dtype, so every float tensor is widened to float32).
void save_npy_f32(const std::string& path, const TensorView& tensor);

}  // namespace bsattn::tools
