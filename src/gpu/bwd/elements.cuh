// Loads and stores of elements of a tensor whose dtype is a run-time value (O, dO, and the
// gradients, which may be f32 or the input dtype), in fp32: one at a time, or eight by 16-byte
// vectors where their address allows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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

// 8 f16 or bf16 elements held as 16 raw bytes, in fp32.
__device__ __forceinline__ void unpack8(const uint4& v, ElementType t, float x[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 f;
    if (t == ElementType::f16) f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
    else f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
    x[2 * k] = f.x, x[2 * k + 1] = f.y;
  }
}

// Elements i .. i + 7 in fp32 by 16-byte loads (the caller checked vector_aligned).
__device__ __forceinline__ void load_elements8(const void* base, std::int64_t i, ElementType t, float x[8]) {
  if (t == ElementType::f32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 lo = p[0], hi = p[1];
    x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
    return;
  }
  unpack8(*reinterpret_cast<const uint4*>(static_cast<const char*>(base) + 2 * i), t, x);
}

// The dot product of 8 f16 or bf16 elements held as 16 raw bytes each, in fp32.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, ElementType t) {
  float x[8], y[8];
  unpack8(a, t, x);
  unpack8(b, t, y);
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) sum += x[k] * y[k];
  return sum;
}

// x[0 .. 7] into elements i .. i + 7 by 16-byte stores (the caller checked vector_aligned).
__device__ __forceinline__ void store_elements8(void* base, std::int64_t i, ElementType t, const float x[8]) {
  if (t == ElementType::f32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(x[0], x[1], x[2], x[3]);
    p[1] = make_float4(x[4], x[5], x[6], x[7]);
    return;
  }
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (t == ElementType::f16) {
      const __half2 h = __floats2half2_rn(x[2 * k], x[2 * k + 1]);
      w[k] = *reinterpret_cast<const unsigned*>(&h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * k], x[2 * k + 1]);
      w[k] = *reinterpret_cast<const unsigned*>(&h);
    }
  }
  *reinterpret_cast<uint4*>(static_cast<char*>(base) + 2 * i) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Whether elements i .. i + 7 of a tensor of dtype t start on a 16-byte boundary.
__device__ __forceinline__ bool vector_aligned(const void* base, std::int64_t i, ElementType t) {
  const int size = t == ElementType::f32 ? 4 : 2;
  return (reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uint64_t>(i) * size) % 16 == 0;
}

}  // namespace bsattn::gpu::bwd
