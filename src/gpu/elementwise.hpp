// Element-wise fp32 work of the context-parallel path (src/distributed/scratch.cpp) on the GPU:
// buffers filled with a value, sums of gradient parts, and fp32 results rounded into a caller's
// tensor. Each launches one kernel on `stream` (no host synchronisation, no allocation).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "bsattn/tensor.hpp"

namespace bsattn::gpu {

cudaError_t fill_f32(float* dst, float value, std::int64_t n, cudaStream_t stream);
// dst[i] += src[i] for i < n.
cudaError_t add_f32(float* dst, const float* src, std::int64_t n, cudaStream_t stream);
// `src`, contiguous fp32 of dst's shape, into `dst`: rank 4, f32 / f16 / bf16, any strides with a
// contiguous last dimension; rounded to nearest even.
cudaError_t store_f32(const float* src, const TensorView& dst, cudaStream_t stream);

}  // namespace bsattn::gpu
