// Block selection kernel (SPEC §7). A CTA takes up to kMaxRows consecutive Q blocks of one
// (sequence, sparsity head): it pools their Q tokens (16-byte vectors along D: coalesced rows), scores
// every visible KV block against all of its rows at once (a thread per KV block, the summary row
// read once in 16-byte vectors for all rows; the same fma order as the CPU), then applies the
// policy to one row at a time with all threads (a bitonic sort of the row's keys in shared memory
// for top_k and mass, chunked sums for tau and mass) and writes the row's words. Every word of the
// output is written: varlen rows past the last sequence's blocks by trailing CTAs.
#include "gpu/select_blocks.hpp"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace bsattn::gpu {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxRows = 8;
constexpr int kVector = 8;  // elements per summary load; head_dim is a multiple of 8

// kVector consecutive elements (16-byte aligned: summary rows are validated as 16-byte vectors).
template <ElementType T>
__device__ __forceinline__ void load_vector(const void* base, std::int64_t offset, float (&out)[kVector]) {
  if constexpr (T == ElementType::f32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + offset);
    const float4 a = p[0], b = p[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const std::uint16_t*>(base) + offset);
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t lo = static_cast<std::uint16_t>(words[i] & 0xffffu), hi = static_cast<std::uint16_t>(words[i] >> 16);
      if constexpr (T == ElementType::f16) {
        out[2 * i] = __half2float(__ushort_as_half(lo));
        out[2 * i + 1] = __half2float(__ushort_as_half(hi));
      } else {
        out[2 * i] = __uint_as_float(static_cast<std::uint32_t>(lo) << 16);
        out[2 * i + 1] = __uint_as_float(static_cast<std::uint32_t>(hi) << 16);
      }
    }
  }
}

// Shared memory of one CTA, carved from the dynamic allocation (sizes from the launch).
struct SharedLayout {
  int rows, score_stride, key_slots, chunks, words;
  __host__ __device__ std::size_t pooled_bytes(int d) const { return sizeof(float) * rows * d; }
  __host__ __device__ std::size_t bytes(int d) const {
    return sizeof(std::uint64_t) * key_slots + pooled_bytes(d) + sizeof(float) * rows * score_stride +
           sizeof(float) * chunks + sizeof(std::uint32_t) * words + 3 * sizeof(float);
  }
};

__device__ void bitonic_sort_descending(std::uint64_t* keys, int n) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const std::uint64_t a = keys[i], b = keys[partner];
          if (((i & k) == 0) ? a < b : a > b) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      // Thread t owns elements t + 128 r, so a stage with j < 32 pairs elements of one warp: the
      // CTA waits only around stages that pair across warps (the next stage is (k, j/2) or (2k, k)).
      const int next = j > 1 ? j >> 1 : k;
      if (j >= 32 || next >= 32) __syncthreads();
      else __syncwarp();
    }
  __syncthreads();
}

// Number of blocks of Q with varlen rows before sequence b (the row base of the varlen bitmask).
__device__ int varlen_row_base(const route::RouteParams& p, int b) {
  int base = 0;
  for (int i = 0; i < b; ++i) base += route::ceil_div(p.cu_seqlens_q[i + 1] - p.cu_seqlens_q[i], p.block_q);
  return base;
}

// The policy's blocks of one row, ORed into `words` (shared). Every thread calls it.
__device__ void apply_policy(const route::SelectRule& rule, const route::SelectRowShape& shape, const float* scores,
                             std::uint64_t* keys, float* partial, float* broadcast, int* counter,
                             std::uint32_t* words, int forced_count) {
  const int n = shape.visible;
  const int chunks = route::ceil_div(n, route::kSelectChunk);
  const auto chunk_end = [&](int c) { return min(n, (c + 1) * route::kSelectChunk); };
  const auto set_bit = [&](int j) { atomicOr(&words[j / 32], 1u << (j % 32)); };
  if (rule.policy == route::SelectPolicyKind::tau) {
    for (int c = threadIdx.x; c < chunks; c += kThreads)
      partial[c] = route::chunk_fold(c * route::kSelectChunk, chunk_end(c),
                                     [&](float acc, int j) { return route::fold_sum(acc, scores[j]); });
    __syncthreads();
    if (threadIdx.x == 0) broadcast[0] = route::row_mean(route::sum_chunks(chunks, [&](int c) { return partial[c]; }), n);
    __syncthreads();
    const float mean = broadcast[0];
    for (int c = threadIdx.x; c < chunks; c += kThreads)
      partial[c] = route::chunk_fold(c * route::kSelectChunk, chunk_end(c), [&](float acc, int j) {
        return route::fold_squared_deviation(acc, scores[j], mean);
      });
    __syncthreads();
    if (threadIdx.x == 0)
      broadcast[1] = route::tau_threshold(mean, route::sum_chunks(chunks, [&](int c) { return partial[c]; }), n, rule.tau);
    __syncthreads();
    const float threshold = broadcast[1];
    for (int j = threadIdx.x; j < n; j += kThreads)
      if (scores[j] >= threshold) set_bit(j);
    return;
  }

  // top_k and mass rank blocks: keys of the candidates, 0 in the other slots, sorted descending.
  const bool top_k = rule.policy == route::SelectPolicyKind::top_k;
  int slots = 1;
  while (slots < n) slots <<= 1;
  for (int i = threadIdx.x; i < slots; i += kThreads)
    keys[i] = (i < n && !(top_k && route::select_forced(rule, shape, i))) ? route::select_key(scores[i], i) : 0;
  __syncthreads();
  bitonic_sort_descending(keys, slots);
  if (top_k) {
    const int picks = max(0, rule.top_k - forced_count);
    for (int i = threadIdx.x; i < min(picks, n); i += kThreads)
      if (keys[i] != 0) set_bit(route::select_key_block(keys[i]));
    return;
  }
  const auto sorted_score = [&](int i) { return scores[route::select_key_block(keys[i])]; };
  const float row_max = sorted_score(0);
  for (int c = threadIdx.x; c < chunks; c += kThreads)
    partial[c] = route::chunk_fold(c * route::kSelectChunk, chunk_end(c), [&](float acc, int i) {
      return route::fold_mass(acc, sorted_score(i), row_max);
    });
  __syncthreads();
  if (threadIdx.x == 0) {  // chunk totals -> offsets, in the CPU engine's order; the last is the total
    float offset = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const float total = partial[c];
      partial[c] = offset;
      offset = route::add_rn(offset, total);
    }
    broadcast[2] = route::mass_target(rule.mass, offset);
    *counter = 0;
  }
  __syncthreads();
  const float target = broadcast[2];
  int below = 0;
  for (int c = threadIdx.x; c < chunks; c += kThreads)
    below += route::mass_below_target(c * route::kSelectChunk, chunk_end(c), partial[c], row_max, target, sorted_score);
  if (below) atomicAdd(counter, below);
  __syncthreads();
  const int picks = min(n, *counter + 1);
  for (int i = threadIdx.x; i < picks; i += kThreads) set_bit(route::select_key_block(keys[i]));
}

template <ElementType T>
__global__ void __launch_bounds__(kThreads, 1) select_kernel(const route::SelectParams sp, const SharedLayout layout,
                                                          int groups_per_sequence) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const AttentionParams& a = sp.tensors;
  const route::RouteParams& p = a.route;
  const int d = a.head_dim, hs = blockIdx.y;
  auto* keys = reinterpret_cast<std::uint64_t*>(shared_raw);
  float* pooled = reinterpret_cast<float*>(keys + layout.key_slots);
  float* scores = pooled + layout.rows * d;
  float* partial = scores + layout.rows * layout.score_stride;
  std::uint32_t* words = reinterpret_cast<std::uint32_t*>(partial + layout.chunks);
  float* broadcast = reinterpret_cast<float*>(words + layout.words);  // mean, tau threshold, mass target
  __shared__ int forced_count, counter;

  const std::int64_t word_stride = sp.word_stride();
  const int sequence = blockIdx.x / groups_per_sequence;
  if (sequence >= p.batch) {  // varlen: zero the bitmask rows past the last sequence's blocks
    const int total = varlen_row_base(p, p.batch);
    const int first = (blockIdx.x - p.batch * groups_per_sequence) * layout.rows;
    for (int i = threadIdx.x; i < layout.rows * sp.words; i += kThreads) {
      const int row = first + i / sp.words;
      if (row >= total && row < sp.rows) sp.row_words(hs, row)[(i % sp.words) * word_stride] = 0;
    }
    return;
  }
  const int b = sequence, qb0 = (blockIdx.x % groups_per_sequence) * layout.rows;
  const route::SeqInfo s = route::seq_info(p, b);
  const int rows = min(layout.rows, s.q_blocks - qb0);
  if (rows <= 0) return;
  const int row0 = p.varlen_q ? varlen_row_base(p, b) + qb0 : b * p.max_q_blocks + qb0;

  // Pool: a thread per (row, 8 consecutive elements) reads them as one 16-byte vector (Q rows are
  // validated as 16-byte vectors); each element sums the row's query heads, then its tokens, in order.
  const int vectors = d / kVector;
  for (int i = threadIdx.x; i < rows * vectors; i += kThreads) {
    const int r = i / vectors, e0 = (i % vectors) * kVector;
    const int q0 = (qb0 + r) * p.block_q, q1 = min(q0 + p.block_q, s.seqlen_q);
    float sum[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) sum[e] = 0.0f;
    for (int h = hs * sp.group; h < (hs + 1) * sp.group; ++h)
#pragma unroll 4
      for (int q = q0; q < q1; ++q) {
        float x[kVector];
        load_vector<T>(a.q, a.q_offset(b, s, q, h) + e0, x);
#pragma unroll
        for (int e = 0; e < kVector; ++e) sum[e] = route::add_rn(sum[e], x[e]);
      }
#pragma unroll
    for (int e = 0; e < kVector; ++e) pooled[r * d + e0 + e] = route::pooled_query(sum[e], q1 - q0, a.scale);
  }
  __syncthreads();

  // Scores of every block visible to the last (widest) row, for all rows at once.
  const int visible = route::select_row_shape(sp.rule, s, p.block_q, p.block_kv, qb0 + rows - 1).visible;
  const int hkv = hs * sp.group / (p.heads_q / p.heads_kv);
  const std::int64_t summary = b * a.summary_batch_stride + hkv * a.summary_head_stride;
  for (int j = threadIdx.x; j < visible; j += kThreads) {
    float acc[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) acc[r] = 0.0f;
    for (int e0 = 0; e0 < d; e0 += kVector) {
      float k[kVector];
      load_vector<T>(a.k_summary, summary + j * a.summary_block_stride + e0, k);
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r)
        if (r < rows) {
          // The row's 8 pooled values in two 16-byte shared loads (one broadcast for the warp).
          const float4 lo = *reinterpret_cast<const float4*>(pooled + r * d + e0);
          const float4 hi = *reinterpret_cast<const float4*>(pooled + r * d + e0 + 4);
          const float qv[kVector] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int e = 0; e < kVector; ++e) acc[r] = route::fma_rn(qv[e], k[e], acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) scores[r * layout.score_stride + j] = acc[r];
  }
  __syncthreads();

  for (int r = 0; r < rows; ++r) {
    const route::SelectRowShape shape = route::select_row_shape(sp.rule, s, p.block_q, p.block_kv, qb0 + r);
    for (int w = threadIdx.x; w < sp.words; w += kThreads) words[w] = 0;
    if (threadIdx.x == 0) forced_count = 0;
    __syncthreads();
    int forced = 0;
    for (int j = threadIdx.x; j < shape.visible; j += kThreads)
      if (route::select_forced(sp.rule, shape, j)) {
        atomicOr(&words[j / 32], 1u << (j % 32));
        ++forced;
      }
    if (forced) atomicAdd(&forced_count, forced);
    __syncthreads();
    if (shape.visible > 0)
      apply_policy(sp.rule, shape, scores + r * layout.score_stride, keys, partial, broadcast, &counter, words,
                   forced_count);
    __syncthreads();
    std::uint32_t* out = sp.row_words(hs, row0 + r);
    for (int w = threadIdx.x; w < sp.words; w += kThreads) out[w * word_stride] = words[w];
    __syncthreads();
  }
}

template <ElementType T>
cudaError_t launch(const route::SelectParams& sp, cudaStream_t stream) {
  const route::RouteParams& p = sp.tensors.route;
  SharedLayout layout;
  const int kv_blocks = std::max(1, sp.max_kv_blocks);
  // Rows per CTA: as many as keep the score rows within 64 KiB (the summary row is read once for them).
  layout.rows = std::clamp(16384 / kv_blocks, 1, kMaxRows);
  layout.score_stride = kv_blocks;
  layout.key_slots = 2;  // keeps the pooled rows after the keys 16-byte aligned
  while (layout.key_slots < kv_blocks) layout.key_slots <<= 1;
  layout.chunks = route::ceil_div(kv_blocks, route::kSelectChunk);
  layout.words = sp.words;
  const std::size_t bytes = layout.bytes(sp.tensors.head_dim);
  // Above the default 48 KiB only (long KV sequences): typical shapes make no extra API call, and
  // none that a graph capture could object to.
  if (bytes > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(select_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return e;
  }
  const int groups_per_sequence = route::ceil_div(p.max_q_blocks, layout.rows);
  const int trailing = p.varlen_q ? route::ceil_div(sp.rows, layout.rows) : 0;
  const dim3 grid(p.batch * groups_per_sequence + trailing, sp.heads);
  select_kernel<T><<<grid, kThreads, bytes, stream>>>(sp, layout, groups_per_sequence);
  return cudaGetLastError();
}

}  // namespace

cudaError_t select_blocks(const route::SelectParams& sp, cudaStream_t stream) {
  if (sp.max_kv_blocks > kSelectMaxKvBlocks) return cudaErrorInvalidValue;
  switch (sp.tensors.in_type) {
    case ElementType::f32: return launch<ElementType::f32>(sp, stream);
    case ElementType::f16: return launch<ElementType::f16>(sp, stream);
    default: return launch<ElementType::bf16>(sp, stream);
  }
}

}  // namespace bsattn::gpu
