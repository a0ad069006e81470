// Block selection kernel (SPEC §7). A CTA of 8 warps takes up to 8 consecutive Q blocks of one
// (sequence, sparsity head):
//  * pooling: a thread per (row, 8 consecutive elements of D) sums the row's query heads, then its
//    tokens, in order, loading 128 bytes of them (8 tokens of bf16) before adding them, with the
//    next 128 bytes prefetched to L2: Q is the kernel's only DRAM stream;
//  * scoring: a thread per two KV blocks scores them against every row of the CTA (16 fma chains
//    in registers; a summary vector of 8 elements read once from L2 for all rows, the rows' pooled
//    values as shared-memory broadcasts), the CPU's fma order along D;
//  * policy: a warp per row, with warp barriers only. top_k: a radix select of the k-th largest
//    score key, bit by bit from the top, counting the keys at or above each trial (held in
//    registers, 16 per lane, up to 512 blocks), stopped as soon as a trial counts exactly k; keys
//    equal to the threshold are taken by lower block index, which makes the set the sort's. tau:
//    the chunked mean and std. mass: a bitonic sort of the row's 64-bit keys in the warp's shared
//    slice. Each word of the row's bits is then one warp ballot.
// Every word of the output is written: varlen rows past the last sequence's blocks by trailing CTAs.
#include "gpu/select_blocks.hpp"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace bsattn::gpu {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRows = kWarps;       // a warp applies the policy to one row
constexpr int kBlocksPerThread = 2;    // KV blocks one thread scores (against every row of the CTA)
static_assert(kThreads % 32 == 0, "score_slot(j + kThreads) = score_slot(j) + score_slot(kThreads)");
constexpr int kVector = 8;             // elements per Q / summary load; head_dim is a multiple of 8
constexpr int kPoolBatchBytes = 128;   // Q bytes a pooling thread loads before adding them
constexpr unsigned kFullWarp = 0xffffffffu;

// Score slot of KV block j in a row: a padding word after every 32 blocks, so that the lanes of a
// warp folding one chunk of 32 blocks each read distinct banks.
__host__ __device__ __forceinline__ int score_slot(int j) { return j + (j >> 5); }

// kVector consecutive elements as loaded (16-byte aligned: Q and summary rows are validated as
// 16-byte vectors), converted to float separately so that loads can be issued ahead of the adds.
template <ElementType T>
struct Packed {
  uint4 lo;
};
template <>
struct Packed<ElementType::f32> {
  uint4 lo, hi;
};

template <ElementType T>
__device__ __forceinline__ Packed<T> load_packed(const void* base, std::int64_t offset) {
  Packed<T> v;
  if constexpr (T == ElementType::f32) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const float*>(base) + offset);
    v.lo = p[0];
    v.hi = p[1];
  } else {
    v.lo = *reinterpret_cast<const uint4*>(static_cast<const std::uint16_t*>(base) + offset);
  }
  return v;
}

// Asks L2 for the line holding a vector that load_packed will read later (no register is held).
template <ElementType T>
__device__ __forceinline__ void prefetch_packed(const void* base, std::int64_t offset) {
#if defined(__CUDA_ARCH__)
  using Element = std::conditional_t<T == ElementType::f32, float, std::uint16_t>;
  asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const Element*>(base) + offset));
#else
  (void)base, (void)offset;
#endif
}

template <ElementType T>
__device__ __forceinline__ void unpack(const Packed<T>& v, float (&out)[kVector]) {
  if constexpr (T == ElementType::f32) {
    const std::uint32_t words[8] = {v.lo.x, v.lo.y, v.lo.z, v.lo.w, v.hi.x, v.hi.y, v.hi.z, v.hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = route::bits_float(words[i]);
  } else {
    const std::uint32_t words[4] = {v.lo.x, v.lo.y, v.lo.z, v.lo.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t lo = static_cast<std::uint16_t>(words[i] & 0xffffu), hi = static_cast<std::uint16_t>(words[i] >> 16);
      if constexpr (T == ElementType::f16) {
        out[2 * i] = __half2float(__ushort_as_half(lo));
        out[2 * i + 1] = __half2float(__ushort_as_half(hi));
      } else {
        out[2 * i] = route::bits_float(static_cast<std::uint32_t>(lo) << 16);
        out[2 * i + 1] = route::bits_float(static_cast<std::uint32_t>(hi) << 16);
      }
    }
  }
}

// Shared memory of one CTA, carved from the dynamic allocation: per row its sort keys (mass only),
// pooled query, scores and chunk partials.
struct SharedLayout {
  int rows = 1, d = 0, score_stride = 0, key_slots = 0, chunks = 0;
  __host__ __device__ std::size_t row_bytes() const {
    return sizeof(std::uint64_t) * key_slots + sizeof(float) * (d + score_stride + chunks);
  }
  __host__ __device__ std::size_t bytes() const { return rows * row_bytes(); }
};

// Sum over the warp (every lane gets it).
__device__ __forceinline__ int warp_sum(int v) { return __reduce_add_sync(kFullWarp, v); }

// Keys a lane holds in registers while searching a row of up to 32 * kKeysPerLane blocks (longer
// rows are searched in shared memory).
constexpr int kKeysPerLane = 16;

// The picks-th largest (1 <= picks <= number of nonzero keys) of a row's 32-bit keys, searched bit by
// bit: the largest t with count_at_least(t) >= picks, where count_at_least(t) counts the row's keys
// >= t over the warp. Returns the threshold and the keys equal to it to take (lowest blocks
// first) above those greater than it: a trial that counts exactly picks keys separates them from
// the rest (threshold trial - 1, no ties), which usually ends the search half way.
template <class CountAtLeast>
__device__ __forceinline__ void kth_largest_key(int picks, const CountAtLeast& count_at_least, std::uint32_t& threshold,
                                                int& ties_left) {
  threshold = 0;
  ties_left = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const std::uint32_t trial = threshold | (1u << bit);
    const int count = count_at_least(trial);
    if (count == picks) {
      threshold = trial - 1;
      return;
    }
    if (count > picks) threshold = trial;
  }
  ties_left = picks - count_at_least(threshold + 1);
}

// Sum of fold(acc, j) over j in [0, n), chunk by chunk (a lane per chunk of kSelectChunk blocks),
// the chunk results added in order: route/selection.hpp's order. Every lane gets the sum.
template <class Fold>
__device__ float warp_chunked_sum(int n, float* partial, int lane, const Fold& fold) {
  const int chunks = route::ceil_div(n, route::kSelectChunk);
  for (int c = lane; c < chunks; c += 32)
    partial[c] = route::chunk_fold(c * route::kSelectChunk, min(n, (c + 1) * route::kSelectChunk), fold);
  __syncwarp();
  const float sum = route::sum_chunks(chunks, [&](int c) { return partial[c]; });
  __syncwarp();  // partial is reused by the next call
  return sum;
}

// Descending bitonic sort of n (a power of two) keys by one warp.
__device__ void warp_bitonic_sort_descending(std::uint64_t* keys, int n, int lane) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = lane; i < n; i += 32) {
        const int partner = i ^ j;
        if (partner > i) {
          const std::uint64_t a = keys[i], b = keys[partner];
          if (((i & k) == 0) ? a < b : a > b) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncwarp();
    }
}

// Scores of kCount KV blocks kThreads apart (summary rows from `summary`, every one visible) against
// the CTA's rows: an fma chain per (row, block) over d = 0, 1, ..., each summary vector of 8
// elements read once for all rows, the rows' pooled values as shared broadcasts. Written to
// scores[r * score_stride + slot offset of block c].
template <ElementType T, int kCount>
__device__ __forceinline__ void score_blocks(const AttentionParams& a, std::int64_t summary, const float* pooled, int d,
                                             int rows, float* scores, int score_stride) {
  float acc[kCount][kMaxRows];
#pragma unroll
  for (int c = 0; c < kCount; ++c)
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) acc[c][r] = 0.0f;
  for (int e0 = 0; e0 < d; e0 += kVector) {
    float k[kCount][kVector];
#pragma unroll
    for (int c = 0; c < kCount; ++c)
      unpack<T>(load_packed<T>(a.k_summary, summary + c * kThreads * a.summary_block_stride + e0), k[c]);
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) {
        // The row's 8 pooled values in two 16-byte shared loads (one broadcast for the warp).
        const float4 lo = *reinterpret_cast<const float4*>(pooled + r * d + e0);
        const float4 hi = *reinterpret_cast<const float4*>(pooled + r * d + e0 + 4);
        const float qv[kVector] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int c = 0; c < kCount; ++c)
#pragma unroll
          for (int e = 0; e < kVector; ++e) acc[c][r] = route::fma_rn(qv[e], k[c][e], acc[c][r]);
      }
  }
  // kThreads blocks apart is kThreads + kThreads / 32 score slots (a padding word per 32 blocks).
#pragma unroll
  for (int c = 0; c < kCount; ++c)
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) scores[r * score_stride + c * score_slot(kThreads)] = acc[c][r];
}

// Number of blocks of Q with varlen rows before sequence b (the row base of the varlen bitmask).
__device__ int varlen_row_base(const route::RouteParams& p, int b) {
  int base = 0;
  for (int i = 0; i < b; ++i) base += route::ceil_div(p.cu_seqlens_q[i + 1] - p.cu_seqlens_q[i], p.block_q);
  return base;
}

// One row's policy and its bitmask words, by one warp. `scores` holds the row's scores in score
// slots (top_k overwrites them with its 32-bit keys); `keys` has a power of two >= n slots (mass).
__device__ void select_row(const route::SelectParams& sp, const route::SelectRowShape& shape, float* scores,
                           float* partial, std::uint64_t* keys, int hs, int row, int lane) {
  const route::SelectRule& rule = sp.rule;
  const int n = shape.visible;
  const auto score = [&](int j) { return scores[score_slot(j)]; };
  // The policy's pick of visible block j (forced blocks are added below): top_k keeps keys above
  // `threshold` and the first `ties_left` keys equal to it (block order); tau keeps scores >= it;
  // mass keeps 64-bit keys >= the key at the cut.
  std::uint32_t threshold = 0;
  int ties_left = 0;
  float tau_threshold = 0.0f;
  std::uint64_t mass_cut = ~std::uint64_t{0};
  std::uint32_t* top_keys = reinterpret_cast<std::uint32_t*>(scores);
  if (n > 0 && rule.policy == route::SelectPolicyKind::top_k) {
    int forced = 0;
    for (int j = lane; j < n; j += 32) {
      const bool is_forced = route::select_forced(rule, shape, j);
      forced += is_forced ? 1 : 0;
      // The ranking key's score half; 0 (below every block's key) for forced blocks, which top_k
      // counts but does not rank.
      top_keys[score_slot(j)] = is_forced ? 0u : static_cast<std::uint32_t>(route::select_key(score(j), j) >> 32);
    }
    forced = warp_sum(forced);
    const int picks = min(n - forced, max(0, rule.top_k - forced));
    __syncwarp();
    if (picks > 0 && n <= 32 * kKeysPerLane) {
      std::uint32_t held[kKeysPerLane];
#pragma unroll
      for (int i = 0; i < kKeysPerLane; ++i) held[i] = lane + 32 * i < n ? top_keys[score_slot(lane + 32 * i)] : 0u;
      kth_largest_key(picks, [&](std::uint32_t trial) {
        int count = 0;
#pragma unroll
        for (int i = 0; i < kKeysPerLane; ++i) count += held[i] >= trial ? 1 : 0;
        return warp_sum(count);
      }, threshold, ties_left);
    } else if (picks > 0) {
      kth_largest_key(picks, [&](std::uint32_t trial) {
        int count = 0;
        for (int j = lane; j < n; j += 32) count += top_keys[score_slot(j)] >= trial ? 1 : 0;
        return warp_sum(count);
      }, threshold, ties_left);
    } else {
      threshold = ~0u;  // above every key: nothing picked
    }
  } else if (n > 0 && rule.policy == route::SelectPolicyKind::tau) {
    const float mean = route::row_mean(
        warp_chunked_sum(n, partial, lane, [&](float acc, int j) { return route::fold_sum(acc, score(j)); }), n);
    const float squares = warp_chunked_sum(
        n, partial, lane, [&](float acc, int j) { return route::fold_squared_deviation(acc, score(j), mean); });
    tau_threshold = route::tau_threshold(mean, squares, n, rule.tau);
  } else if (n > 0) {
    int slots = 1;
    while (slots < n) slots <<= 1;
    for (int i = lane; i < slots; i += 32) keys[i] = i < n ? route::select_key(score(i), i) : 0;
    __syncwarp();
    warp_bitonic_sort_descending(keys, slots, lane);
    const auto sorted_score = [&](int i) { return score(route::select_key_block(keys[i])); };
    const float row_max = sorted_score(0);
    const int chunks = route::ceil_div(n, route::kSelectChunk);
    const auto chunk_end = [&](int c) { return min(n, (c + 1) * route::kSelectChunk); };
    for (int c = lane; c < chunks; c += 32)
      partial[c] = route::chunk_fold(c * route::kSelectChunk, chunk_end(c), [&](float acc, int i) {
        return route::fold_mass(acc, sorted_score(i), row_max);
      });
    __syncwarp();
    if (lane == 0) {  // chunk totals -> offsets, in the CPU engine's order; the last sum is the total
      float offset = 0.0f;
      for (int c = 0; c < chunks; ++c) {
        const float total = partial[c];
        partial[c] = offset;
        offset = route::add_rn(offset, total);
      }
      partial[chunks] = route::mass_target(rule.mass, offset);
    }
    __syncwarp();
    const float target = partial[chunks];
    int below = 0;
    for (int c = lane; c < chunks; c += 32)
      below += route::mass_below_target(c * route::kSelectChunk, chunk_end(c), partial[c], row_max, target, sorted_score);
    const int picks = min(n, warp_sum(below) + 1);
    mass_cut = keys[picks - 1];
  }

  std::uint32_t* out = sp.row_words(hs, row);
  const std::int64_t word_stride = sp.word_stride();
  int ties_before = 0;  // top_k: keys equal to the threshold in earlier words
  for (int w = 0; w < sp.words; ++w) {
    const int j = 32 * w + lane;
    bool pick = false, tie = false;
    if (j < n) {
      if (rule.policy == route::SelectPolicyKind::top_k) {
        const std::uint32_t key = top_keys[score_slot(j)];
        pick = key > threshold;
        tie = key == threshold && ties_left > 0;
      } else if (rule.policy == route::SelectPolicyKind::tau) {
        pick = score(j) >= tau_threshold;
      } else {
        pick = route::select_key(score(j), j) >= mass_cut;
      }
    }
    const std::uint32_t tie_lanes = __ballot_sync(kFullWarp, tie);
    if (tie && ties_before + __popc(tie_lanes & ((1u << lane) - 1u)) < ties_left) pick = true;
    ties_before += __popc(tie_lanes);
    pick = pick || (j < n && route::select_forced(rule, shape, j));
    const std::uint32_t word = __ballot_sync(kFullWarp, pick);
    if (lane == 0) out[w * word_stride] = word;
  }
}

template <ElementType T>
__global__ void __launch_bounds__(kThreads, 4) select_kernel(const route::SelectParams sp, const SharedLayout layout,
                                                          int groups_per_sequence) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const AttentionParams& a = sp.tensors;
  const route::RouteParams& p = a.route;
  const int d = a.head_dim, hs = blockIdx.y;
  auto* keys = reinterpret_cast<std::uint64_t*>(shared_raw);                   // [rows][key_slots]
  float* pooled = reinterpret_cast<float*>(keys + layout.rows * layout.key_slots);  // [rows][d]
  float* scores = pooled + layout.rows * d;                                      // [rows][score_stride]
  float* partial = scores + layout.rows * layout.score_stride;                   // [rows][chunks]

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

  // Pool: a thread per (row, 8 consecutive elements); each element sums the row's query heads, then
  // its tokens, in order. Q offsets are affine in the token: one q_offset per (row, head).
  constexpr int batch_tokens = kPoolBatchBytes / sizeof(Packed<T>);
  const int vectors = d / kVector;
  for (int i = threadIdx.x; i < rows * vectors; i += kThreads) {
    const int r = i / vectors, e0 = (i % vectors) * kVector;
    const int q0 = (qb0 + r) * p.block_q, q1 = min(q0 + p.block_q, s.seqlen_q);
    float sum[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) sum[e] = 0.0f;
    for (int h = hs * sp.group; h < (hs + 1) * sp.group; ++h) {
      std::int64_t offset = a.q_offset(b, s, q0, h) + e0;
      for (int q = q0; q < q1; q += batch_tokens, offset += batch_tokens * a.q_token_stride) {
        Packed<T> batch[batch_tokens];
#pragma unroll
        for (int t = 0; t < batch_tokens; ++t)
          if (q + t < q1) batch[t] = load_packed<T>(a.q, offset + t * a.q_token_stride);
        // The next batch goes to L2 while this one loads: twice the bytes in flight, no registers.
#pragma unroll 1
        for (int t = batch_tokens; t < 2 * batch_tokens && q + t < q1; ++t)
          prefetch_packed<T>(a.q, offset + t * a.q_token_stride);
#pragma unroll
        for (int t = 0; t < batch_tokens; ++t)
          if (q + t < q1) {
            float x[kVector];
            unpack<T>(batch[t], x);
#pragma unroll
            for (int e = 0; e < kVector; ++e) sum[e] = route::add_rn(sum[e], x[e]);
          }
      }
    }
#pragma unroll
    for (int e = 0; e < kVector; ++e) pooled[r * d + e0 + e] = route::pooled_query(sum[e], q1 - q0, a.scale);
  }
  __syncthreads();

  // Scores of every block visible to the last (widest) row, for all rows at once: a thread per
  // two blocks kThreads apart while both exist, else per block.
  const int visible = route::select_row_shape(sp.rule, s, p.block_q, p.block_kv, qb0 + rows - 1).visible;
  const int hkv = hs * sp.group / (p.heads_q / p.heads_kv);
  const std::int64_t summary = b * a.summary_batch_stride + hkv * a.summary_head_stride;
  for (int j0 = threadIdx.x; j0 < visible; j0 += kBlocksPerThread * kThreads) {
    float* row_scores = scores + score_slot(j0);
    if (j0 + kThreads < visible)
      score_blocks<T, kBlocksPerThread>(a, summary + j0 * a.summary_block_stride, pooled, d, rows, row_scores,
                                        layout.score_stride);
    else
      score_blocks<T, 1>(a, summary + j0 * a.summary_block_stride, pooled, d, rows, row_scores, layout.score_stride);
  }
  __syncthreads();

  // Policy: a warp per row.
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < rows; r += kWarps) {
    const route::SelectRowShape shape = route::select_row_shape(sp.rule, s, p.block_q, p.block_kv, qb0 + r);
    select_row(sp, shape, scores + r * layout.score_stride, partial + r * layout.chunks, keys + r * layout.key_slots, hs,
               row0 + r, lane);
  }
}

template <ElementType T>
cudaError_t launch(const route::SelectParams& sp, cudaStream_t stream) {
  const route::RouteParams& p = sp.tensors.route;
  const int kv_blocks = std::max(1, sp.max_kv_blocks);
  SharedLayout layout;
  layout.d = sp.tensors.head_dim;
  layout.score_stride = (score_slot(kv_blocks - 1) + 4) & ~3;  // keeps every row's pooled values 16-byte aligned
  layout.chunks = (route::ceil_div(kv_blocks, route::kSelectChunk) + 4) & ~3;  // + the mass target
  if (sp.rule.policy == route::SelectPolicyKind::mass) {
    layout.key_slots = 2;  // keeps the pooled rows after the keys 16-byte aligned
    while (layout.key_slots < kv_blocks) layout.key_slots <<= 1;
  }
  // Rows per CTA: a row per warp while they fit in 64 KiB (4 CTAs per SM up to 512 KV blocks; the
  // summary rows are read from L2 once per CTA), else as many as fit, at least one.
  layout.rows = std::clamp(static_cast<int>((64 * 1024) / layout.row_bytes()), 1, kMaxRows);
  const std::size_t bytes = layout.bytes();
  // Above the default 48 KiB only: typical shapes make no extra API call, and none that a graph
  // capture could object to.
  if (bytes > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(select_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return e;
  }
  const int groups_per_sequence = route::ceil_div(p.max_q_blocks, layout.rows);
  const int trailing = p.varlen_q ? route::ceil_div(sp.rows, layout.rows) : 0;
  const dim3 grid(p.batch * groups_per_sequence + trailing, sp.heads);
#if defined(BSATTN_GPU_HOST_EMULATION)  // tests/gpu/emulation: the kernel's logic on the host
  emulate_launch(select_kernel<T>, grid, kThreads, bytes, sp, layout, groups_per_sequence);
#else
  select_kernel<T><<<grid, kThreads, bytes, stream>>>(sp, layout, groups_per_sequence);
#endif
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
