#include "gpu/elementwise.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace bsattn::gpu {
namespace {

constexpr int kThreads = 256;

// Enough blocks to fill the GPU several times over; each thread strides through the rest.
unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 8192));
}

__global__ void fill_kernel(float* dst, float value, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(kThreads) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * kThreads)
    dst[i] = value;
}

__global__ void add_kernel(float* dst, const float* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(kThreads) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * kThreads)
    dst[i] += src[i];
}

struct Destination {
  void* data;
  std::int64_t shape[4], stride[4];
};

template <class T>
__device__ T round_to(float x);
template <>
__device__ float round_to<float>(float x) { return x; }
template <>
__device__ __half round_to<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 round_to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <class T>
__global__ void store_kernel(const float* src, Destination d) {
  const std::int64_t n = d.shape[0] * d.shape[1] * d.shape[2] * d.shape[3];
  for (std::int64_t i = blockIdx.x * std::int64_t(kThreads) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * kThreads) {
    std::int64_t rest = i;
    std::int64_t offset = 0;
    for (int dim = 3; dim >= 0; --dim) {
      offset += (rest % d.shape[dim]) * d.stride[dim];
      rest /= d.shape[dim];
    }
    static_cast<T*>(d.data)[offset] = round_to<T>(src[i]);
  }
}

}  // namespace

cudaError_t fill_f32(float* dst, float value, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  fill_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, value, n);
  return cudaGetLastError();
}

cudaError_t add_f32(float* dst, const float* src, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}

cudaError_t store_f32(const float* src, const TensorView& dst, cudaStream_t stream) {
  Destination d{dst.data, {}, {}};
  for (int dim = 0; dim < 4; ++dim) d.shape[dim] = dst.shape[dim], d.stride[dim] = dst.stride[dim];
  const std::int64_t n = d.shape[0] * d.shape[1] * d.shape[2] * d.shape[3];
  if (n <= 0) return cudaSuccess;
  switch (dst.dtype) {
    case DType::f32: store_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(src, d); break;
    case DType::f16: store_kernel<__half><<<blocks_for(n), kThreads, 0, stream>>>(src, d); break;
    case DType::bf16: store_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, stream>>>(src, d); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
