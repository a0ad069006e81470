// Loads and stores of one element of a tensor whose dtype is a run-time value (O, dO, and the
// gradients, which may be f32 or the input dtype), in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bsattn/attention_params.hpp"

namespace bsattn::gpu::bwd {

__device__ __forceinline__ float load_element(const void* base, std::int64_t i, ElementType t) {
  switch (t) {
    case ElementType::f32: return static_cast<const float*>(base)[i];
    case ElementType::f16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

__device__ __forceinline__ void store_element(void* base, std::int64_t i, ElementType t, float x) {
  switch (t) {
    case ElementType::f32: static_cast<float*>(base)[i] = x; break;
    case ElementType::f16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    default: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
  }
}

}  // namespace bsattn::gpu::bwd
