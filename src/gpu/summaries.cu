// Proxy summaries (SPEC §6) on the GPU: a streaming reduction that reads K and V exactly once.
//
// One CTA of 256 threads per (batch, KV block, KV head). A thread owns one 16-byte column vector
// of K or of V (D / 8 vectors per row for 16-bit types, D / 4 for f32: the "slots", K's then V's)
// and one token group: group g sums the block's tokens g, g + groups, g + 2 groups, ... in fp32,
// issuing kTokensInFlight independent 16-byte loads before it adds the first. A warp thus reads
// whole rows of K and V (coalesced), and a 64-token block of D = 128 bf16 is one round of loads
// per thread. The groups' partial sums then meet in shared memory, where one thread per output
// element adds them in group order: the summation order is fixed by D and the dtype, so results
// are deterministic. (Alternative not taken: one warp per item summing every token serially;
// it needs 8-16 dependent load rounds per item, so it hides latency only with far more items in
// flight than a one-batch, few-head problem has.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>


#include "bsattn/route/params.hpp"
#include "gpu/summaries.hpp"

namespace bsattn::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensInFlight = 8;  // per thread: 8 x 16 bytes of loads outstanding
// 3 CTAs per SM (<= 85 registers, no spills; 4 would spill at 64): 768 threads with 96 KiB of
// loads outstanding per SM, about 3x what 4.2 TB/s needs at 1 us of memory latency.
constexpr int kMinBlocksPerSm = 3;

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ void round_to(float x, __nv_bfloat16& out) { out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void round_to(float x, __half& out) { out = __float2half_rn(x); }

// A 16-byte vector of 16-bit elements (T2: their pair type), accumulated as fp32.
template <class T, class T2>
struct PairVector {
  using Element = T;
  static constexpr int kElems = 8;
  static __device__ __forceinline__ void add(float (&acc)[kElems], const uint4& raw) {
    const T2* pairs = reinterpret_cast<const T2*>(&raw);
#pragma unroll
    for (int i = 0; i < kElems / 2; ++i) {
      const float2 f = to_float2(pairs[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ T from_float(float x) {
    T out;
    round_to(x, out);
    return out;
  }
};
using Bf16Vector = PairVector<__nv_bfloat16, __nv_bfloat162>;
using F16Vector = PairVector<__half, __half2>;

struct F32Vector {
  using Element = float;
  static constexpr int kElems = 4;
  static __device__ __forceinline__ void add(float (&acc)[kElems], const uint4& raw) {
    acc[0] += __uint_as_float(raw.x);
    acc[1] += __uint_as_float(raw.y);
    acc[2] += __uint_as_float(raw.z);
    acc[3] += __uint_as_float(raw.w);
  }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

// Paged: every token's row comes through block_table; otherwise a block's rows are one stride apart.
template <class Vector, bool Paged>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) summaries_kernel(const AttentionParams a, const SummaryOutputs o) {
  using T = typename Vector::Element;
  constexpr int E = Vector::kElems;
  __shared__ float partial[kThreads * E];  // [group][slot][element] = [threadIdx.x][element]

  const int d = a.head_dim;
  const int cols = d / E;                 // 16-byte vectors per row (D is a multiple of 8)
  const int slots = 2 * cols;             // K's columns, then V's
  const int groups = kThreads / slots;    // token groups (threads past groups * slots idle)
  const int slot = threadIdx.x % slots, group = threadIdx.x / slots;
  const bool is_v = slot >= cols;
  const T* base = static_cast<const T*>(is_v ? a.v : a.k) + (is_v ? slot - cols : slot) * E;
  const std::int64_t batch_stride = is_v ? a.v_batch_stride : a.k_batch_stride;
  const std::int64_t token_stride = is_v ? a.v_token_stride : a.k_token_stride;
  const std::int64_t head_stride = is_v ? a.v_head_stride : a.k_head_stride;
  const int heads = a.route.heads_kv, bk = a.route.block_kv;
  // Item blockIdx.x = (b * nKB + j) * Hkv + h: CTAs in flight together read neighbouring heads.
  const int item = blockIdx.x;
  const int h = item % heads;
  const int j = (item / heads) % o.kv_blocks;
  const int b = item / heads / o.kv_blocks;
  const route::SeqInfo s = route::seq_info(a.route, b);
  const int first = j * bk;
  const int n = max(0, min(bk, s.seqlen_kv - first));  // in-range tokens; 0 past the end

  const T* row0 = base + (Paged ? 0 : a.kv_offset(b, s, first, h, batch_stride, token_stride, head_stride));
  const auto row = [&](int token) {
    return Paged ? base + a.kv_offset(b, s, first + token, h, batch_stride, token_stride, head_stride)
                 : row0 + token * token_stride;
  };
  float acc[E] = {};
  if (group < groups) {
    for (int t = group; t < n; t += kTokensInFlight * groups) {
      uint4 raw[kTokensInFlight];
#pragma unroll
      for (int u = 0; u < kTokensInFlight; ++u) {
        const int token = t + u * groups;
        if (token < n) raw[u] = __ldg(reinterpret_cast<const uint4*>(row(token)));
      }
#pragma unroll
      for (int u = 0; u < kTokensInFlight; ++u)
        if (t + u * groups < n) Vector::add(acc, raw[u]);
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) partial[threadIdx.x * E + e] = acc[e];
  __syncthreads();

  // Output element x of the row [K's D elements, V's D elements]: the groups' sums in order.
  const float inv_n = n > 0 ? 1.0f / static_cast<float>(n) : 0.0f;
  for (int x = threadIdx.x; x < 2 * d; x += kThreads) {
    float sum = partial[x];
    for (int g = 1; g < groups; ++g) sum += partial[g * slots * E + x];
    if (x < d)
      static_cast<T*>(o.k)[b * o.k_batch_stride + j * o.k_block_stride + h * o.k_head_stride + x] =
          Vector::from_float(sum * inv_n);
    else
      static_cast<T*>(o.v)[b * o.v_batch_stride + j * o.v_block_stride + h * o.v_head_stride + (x - d)] =
          Vector::from_float(sum);
  }
}

}  // namespace

cudaError_t build_summaries(const AttentionParams& a, const SummaryOutputs& o, cudaStream_t stream) {
  const std::int64_t items = static_cast<std::int64_t>(a.route.batch) * o.kv_blocks * a.route.heads_kv;
  if (items == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(items);  // <= INT_MAX: checked by validate_summary_launch
  const auto launch = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(a, o); };
  const bool paged = a.route.paged;
  switch (a.in_type) {
    case ElementType::bf16: launch(paged ? summaries_kernel<Bf16Vector, true> : summaries_kernel<Bf16Vector, false>); break;
    case ElementType::f16: launch(paged ? summaries_kernel<F16Vector, true> : summaries_kernel<F16Vector, false>); break;
    case ElementType::f32: launch(paged ? summaries_kernel<F32Vector, true> : summaries_kernel<F32Vector, false>); break;
  }
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
