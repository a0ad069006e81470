// merge_states on the GPU: a pure stream. Per (row, head) it reads N rows of D elements and N
// LSEs and writes one row and one LSE: the DRAM traffic of a copy, so the ceiling is the device's
// copy bandwidth (4.21 TB/s on the H200) counted as bytes read + written. The LSEs add 4 bytes per
// part and (row, head), 1.5 % of a bf16 row of D = 128, and neighbouring work items take
// neighbouring tokens, so their LSE loads share sectors. Little's law at 4.2 TB/s and ~0.7 us of
// DRAM latency wants ~22 KB in flight per SM: the LSEs and O packs of two parts (eight when there
// are more than two) are loaded together, 32 (128) bytes per thread on the 16-byte path, by 1024
// (512) resident threads per SM. Large merges should so run at 85-95 % of the copy ceiling; small
// ones (a decode step: B * H = 1024 items, a few MB) are bound by the launch and a DRAM latency
// per eight parts.
//
// Work layout: a group of `lanes` threads (a power of two, at most a warp) per (row, head), each
// lane moving packs of `kBytes` along D: 16 when every row start allows it, else 8, 4 or one
// element. The parts are merged in one pass (merge::Accumulator), in part order like the CPU loop.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gpu/merge_states.hpp"

namespace bsattn::gpu {
namespace {

constexpr int kThreads = 256;
// Parts whose loads are in flight together: two for merge_state and large merges, where 4 blocks
// of 256 threads per SM (at most 64 registers, met without spills) keep 1024 x 2 x 16 = 32 KB in
// flight; eight when there are more parts, so that a decode step's merge of 16 splits waits for
// two memory latencies rather than eight (2 blocks per SM then still keep 64 KB in flight).
template <int kPartsInFlight>
constexpr int kBlocksPerSm = kPartsInFlight <= 2 ? 4 : 2;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// kElems consecutive elements of a row, moved by one load or store.
template <class T, int kElems>
struct alignas(sizeof(T) * kElems) Pack {
  T e[kElems];
};

// n / d and n % d, in 32-bit arithmetic when both fit (the 64-bit division is a long routine).
__device__ __forceinline__ void divmod(std::int64_t n, std::int64_t d, std::int64_t& q, std::int64_t& r) {
  if (((n | d) >> 32) == 0) {
    const auto a = static_cast<std::uint32_t>(n), b = static_cast<std::uint32_t>(d);
    q = a / b;
    r = a - static_cast<std::uint32_t>(q) * b;
  } else {
    q = n / d;
    r = n - q * d;
  }
}

template <class T, int kBytes, int kPartsInFlight>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm<kPartsInFlight>)
    merge_states_kernel(const merge::MergeParams p, int lanes_log2) {
  constexpr int kElems = kBytes / static_cast<int>(sizeof(T));
  using Vec = Pack<T, kElems>;
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t item =
      static_cast<std::int64_t>(blockIdx.x) * (kThreads >> lanes_log2) + (threadIdx.x >> lanes_log2);
  const bool active = item < p.items();
  // Tokens fastest: the items of a block read neighbouring LSEs.
  std::int64_t b = 0, h = 0, s = 0, bh = 0;
  if (active) {
    divmod(item, p.tokens, bh, s);
    divmod(bh, p.heads, b, h);
  }
  // Row offsets of both part layouts and of the output, computed once: part i adds i steps.
  const std::int64_t first_row = p.first.out_offset(b, s, h), second_row = p.second.out_offset(b, s, h);
  const std::int64_t first_lse = p.first.lse_offset(b, s, h), second_lse = p.second.lse_offset(b, s, h);
  T* const out = static_cast<T*>(p.result.out) + p.result.out_offset(b, s, h);
  merge::Accumulator a;
  // Every lane passes through the part loop at least once (D = 0 included) for the LSE.
  const int packs = active ? max(p.head_dim / kElems, 1) : 0;
  for (int v = lane; v < packs; v += lanes) {
    const bool has_pack = v * kElems < p.head_dim;
    float acc[kElems] = {};
    a = merge::Accumulator{};
    for (int i0 = 0; i0 < p.parts; i0 += kPartsInFlight) {
      // The LSEs and O packs of a chunk of parts are loaded together (an empty part's O too: it
      // is read but never used), so one memory latency covers the chunk.
      float lse[kPartsInFlight];
      Vec x[kPartsInFlight];
#pragma unroll
      for (int j = 0; j < kPartsInFlight; ++j) {
        const int i = i0 + j;
        if (i >= p.parts) continue;
        lse[j] = p.part(i).lse[i * p.lse_part_step + (i == 0 ? first_lse : second_lse)];
        if (has_pack)
          x[j] = reinterpret_cast<const Vec*>(static_cast<const T*>(p.part(i).out) + i * p.out_part_step +
                                              (i == 0 ? first_row : second_row))[v];
      }
#pragma unroll
      for (int j = 0; j < kPartsInFlight; ++j) {
        if (i0 + j >= p.parts) break;
        float weight;
        const float rescale = a.add(lse[j], weight);
        if (rescale != 1.0f)
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[e] *= rescale;
        if (weight != 0.0f && has_pack)
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[e] += weight * to_float(x[j].e[e]);
      }
    }
    if (!has_pack) break;
    const float inv_sum = a.inv_sum();
    Vec y;
#pragma unroll
    for (int e = 0; e < kElems; ++e) y.e[e] = from_float<T>(acc[e] * inv_sum);
    reinterpret_cast<Vec*>(out)[v] = y;
  }
  // In place the output LSE may be a part's: every lane of the item has read it before this.
  // Groups never straddle a warp, and every lane of the warp gets here.
  __syncwarp();
  if (active && lane == 0 && p.result.lse) p.result.lse[p.result.lse_offset(b, s, h)] = a.lse();
}

// The widest pack (16, 8, 4 or 2 bytes, at least one element) that every row start is aligned
// to: base addresses and the strides of dimensions that are stepped over.
int pack_bytes(const merge::MergeParams& p, int element_bytes) {
  std::uint64_t bits = static_cast<std::uint64_t>(p.head_dim) * element_bytes;
  for (const merge::Layout* l : {&p.first, &p.second, &p.result}) bits |= reinterpret_cast<std::uintptr_t>(l->out);
  const auto stride = [&](std::int64_t extent, std::int64_t elements) {
    if (extent > 1) bits |= static_cast<std::uint64_t>(elements) * element_bytes;
  };
  for (const merge::Layout* l : {&p.first, &p.second, &p.result}) {
    stride(p.batch, l->out_batch_stride);
    stride(p.tokens, l->out_token_stride);
    stride(p.heads, l->out_head_stride);
  }
  stride(p.parts, p.out_part_step);
  int bytes = 16;
  while (bytes > element_bytes && (bits & (bytes - 1)) != 0) bytes /= 2;
  return bytes;
}

template <class T>
cudaError_t launch(const merge::MergeParams& p, cudaStream_t stream) {
  const int bytes = pack_bytes(p, sizeof(T));
  const int packs = p.head_dim * static_cast<int>(sizeof(T)) / bytes;
  int lanes_log2 = 0;
  while ((1 << lanes_log2) < packs && lanes_log2 < 5) ++lanes_log2;
  const std::int64_t blocks = (p.items() + (kThreads >> lanes_log2) - 1) / (kThreads >> lanes_log2);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  const auto run = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(p, lanes_log2); };
  const bool many = p.parts > 2;
  switch (bytes) {
    case 16: many ? run(merge_states_kernel<T, 16, 8>) : run(merge_states_kernel<T, 16, 2>); break;
    case 8: many ? run(merge_states_kernel<T, 8, 8>) : run(merge_states_kernel<T, 8, 2>); break;
    case 4: many ? run(merge_states_kernel<T, 4, 8>) : run(merge_states_kernel<T, 4, 2>); break;
    default:
      if constexpr (sizeof(T) == 2) many ? run(merge_states_kernel<T, 2, 8>) : run(merge_states_kernel<T, 2, 2>);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t merge_states(const merge::MergeParams& p, cudaStream_t stream) {
  if (p.items() == 0) return cudaSuccess;
  switch (p.type) {
    case ElementType::f32: return launch<float>(p, stream);
    case ElementType::f16: return launch<__half>(p, stream);
    case ElementType::bf16: return launch<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace bsattn::gpu
