// merge_states on the GPU: a pure stream. Per (row, head) it reads N rows of D elements and N
// LSEs and writes one row and one LSE: the DRAM traffic of a copy, so the ceiling is the device's
// copy bandwidth (4.21 TB/s on the H200) counted as bytes read + written. The LSEs add 4 bytes per
// part and (row, head), 1.5 % of a bf16 row of D = 128. Neighbouring work items take neighbouring
// rows of O (heads fastest in a [B, S, H, D] layout, tokens in [B, H, S, D]).
//
// Work layout: a group of `lanes` threads (a power of two, at most a warp) per item (row, head),
// each lane moving packs of 16 bytes along D when every row start allows it, else 8, 4 or one
// element. The parts are merged in one pass, in part order like the CPU loop, a chunk of them at a
// time at the chunk's maximum LSE (one rescale of the accumulator per chunk; a merge of one chunk,
// N <= 8 on decode merges and N <= 2 (1 on long rows) on large ones, normalises its weights before adding any O
// and needs none): results differ from the CPU's part-by-part loop by rounding only. Each thread
// loads 8 (part, item, pack) O packs and their LSEs before using any, and a lane does its item's
// per-row work (place, LSEs, weights, division, logarithm) itself:
//  * large merges (at least a wave of resident threads): 4 packs of one item per lane, parts in
//    chunks of 2 (8 packs, one part at a time, on rows of at least 32 packs). Measured on the H200 (2026-12-03, bench/gpu/bench_merge.py, N = 2 to 8): 70-75 %
//    of the copy ceiling in bf16 (91 % f32), against 33-36 % with a pack per lane, where the 16
//    lanes of a D 128 bf16 row each repeated the row's work: ~1,800 instructions per warp for
//    4 KB moved, issue-bound at 16 resident warps per SM (Nsight Compute); with the chunked
//    weights (no rescale per part, no final pass on one chunk) 78-80 %, and with bf16 widened by
//    its bits (fewer registers) 89-92 % (D 64: 74 %), f32 97 %; 8 packs on rows of 32 packs:
//    bf16 D 256 94 %, f32 D 128 100 %;
//  * decode merges (B * H = 1024 items, a few MB): a pack per lane, so that more threads share the
//    few items: 2 parts of 4 items when N <= 2, 4 of 2 when N <= 4, else 8 parts of one item. They
//    are bound by the launch and one DRAM latency per eight parts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "gpu/device_info.hpp"
#include "gpu/index_math.cuh"
#include "gpu/merge_states.hpp"

namespace bsattn::gpu {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
// bf16 widened by its bits: with __bfloat162float the 16-byte kernels needed 124-128 registers
// (52 bytes spilled on decode merges) against 100-114 this way, as f16's conversion does, and
// large bf16 merges ran at 78-80 % of the ceiling against 89-92 % this way.
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16);
}

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

// One (row, head) work item. 32-bit coordinates (the merge's extents are int32); offsets are
// recomputed where used, so that several items per thread cost few registers.
struct Item {
  bool active = false;
  int b = 0, s = 0, h = 0;
};

// Items are numbered with heads or tokens fastest, whichever steps the result's O less, so that
// neighbouring items (a CTA's, and the CTAs resident together) read and write neighbouring rows.
__device__ __forceinline__ Item locate(const merge::MergeParams& p, std::int64_t item, bool heads_fastest) {
  Item it;
  it.active = item < p.items();
  if (!it.active) return it;
  std::int64_t outer = 0, b = 0, s = 0, h = 0;
  if (heads_fastest) {
    divmod(item, p.heads, outer, h);
    divmod(outer, p.tokens, b, s);
  } else {
    divmod(item, p.tokens, outer, s);
    divmod(outer, p.heads, b, h);
  }
  it.b = static_cast<int>(b);
  it.s = static_cast<int>(s);
  it.h = static_cast<int>(h);
  return it;
}

// A group of `lanes` threads merges kItems items (kThreads / lanes apart: each step of k covers
// consecutive items); each lane holds kPacks packs of an item, `lanes` packs apart, so that one
// load instruction of the group reads consecutive packs. The LSEs and O packs of kParts parts of
// every item are loaded before any is used: kItems * kParts * kPacks loads of up to 16 bytes in
// flight per thread. With several items the kernel is launched only for N <= kParts: one chunk of
// parts. Parts and result of type T.
template <class T, int kElems, int kParts, int kItems, int kPacks>
__global__ void __launch_bounds__(kThreads, 2) merge_states_kernel(const merge::MergeParams p, int lanes_log2,
                                                                   bool heads_fastest) {
  using Vec = Pack<T, kElems>;
  const int lanes = 1 << lanes_log2, groups = kThreads >> lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  Item items[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k)
    items[k] = locate(p, (static_cast<std::int64_t>(blockIdx.x) * kItems + k) * groups + (threadIdx.x >> lanes_log2),
                      heads_fastest);
  merge::Accumulator a[kItems];
  const int chunks_end = kItems > 1 ? kParts : p.parts;  // a constant trip count of one with several items
  // Every lane passes through the part loop at least once (D = 0 included) for the LSE.
  const int packs = max(p.head_dim / kElems, 1);
  for (int v0 = lane; v0 < packs; v0 += lanes * kPacks) {
    bool has_pack[kPacks];
#pragma unroll
    for (int q = 0; q < kPacks; ++q) has_pack[q] = (v0 + q * lanes) * kElems < p.head_dim;
    float acc[kItems][kPacks][kElems] = {};
#pragma unroll
    for (int k = 0; k < kItems; ++k) a[k] = merge::Accumulator{};
    for (int i0 = 0; i0 < chunks_end; i0 += kParts) {
      // The LSEs and O packs of a chunk of parts of every item are loaded together (an empty
      // part's O too: it is read but never used), so one memory latency covers them all.
      float lse[kItems][kParts];
      Vec x[kItems][kParts][kPacks];
#pragma unroll
      for (int k = 0; k < kItems; ++k)
#pragma unroll
        for (int j = 0; j < kParts; ++j) {
          const int i = i0 + j;
          if (!items[k].active || i >= p.parts) continue;
          lse[k][j] = p.part_lse(i, items[k].b, items[k].s, items[k].h);
          const Vec* row = reinterpret_cast<const Vec*>(static_cast<const T*>(p.part(i).out) +
                                                        p.part_out_offset(i, items[k].b, items[k].s, items[k].h));
#pragma unroll
          for (int q = 0; q < kPacks; ++q)
            if (has_pack[q]) x[k][j][q] = row[v0 + q * lanes];
        }
      const bool last_chunk = kItems > 1 || i0 + kParts >= p.parts;  // several items: N <= kParts
      // A merge in one chunk knows its sum before it adds any O: its weights are normalised at
      // once and the accumulator needs no pass at the end.
      const bool one_chunk = i0 == 0 && last_chunk;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        if (!items[k].active) continue;
        // The chunk's parts are added at the chunk's maximum (with the exact exponential): one
        // rescale of the accumulator per chunk, none for the first.
        float chunk_max = a[k].max_lse;
#pragma unroll
        for (int j = 0; j < kParts; ++j)
          if (i0 + j < p.parts) chunk_max = merge::Accumulator::max_of(chunk_max, lse[k][j]);
        const float rescale = a[k].template rebase<true>(chunk_max);
        if (i0 > 0 && rescale != 1.0f)
#pragma unroll
          for (int q = 0; q < kPacks; ++q)
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[k][q][e] *= rescale;
        float weight[kParts];
#pragma unroll
        for (int j = 0; j < kParts; ++j) {
          weight[j] = i0 + j < p.parts ? a[k].template weight<true>(lse[k][j]) : 0.0f;
          a[k].sum += weight[j];
        }
        const float inv_sum = a[k].inv_sum();
#pragma unroll
        for (int j = 0; j < kParts; ++j)
          if (weight[j] != 0.0f) {  // an empty part's O is never used
            const float w = one_chunk ? weight[j] * inv_sum : weight[j];
#pragma unroll
            for (int q = 0; q < kPacks; ++q)
              if (has_pack[q])
#pragma unroll
                for (int e = 0; e < kElems; ++e) acc[k][q][e] += w * to_float(x[k][j][q].e[e]);
          }
        // The last chunk finishes the item at once (its accumulator is dead after the store).
        const auto store = [&](auto normalised) {
          Vec* row = reinterpret_cast<Vec*>(static_cast<T*>(p.result.out) +
                                            p.result.out_offset(items[k].b, items[k].s, items[k].h));
#pragma unroll
          for (int q = 0; q < kPacks; ++q)
            if (has_pack[q]) {
              Vec y;
#pragma unroll
              for (int e = 0; e < kElems; ++e)
                y.e[e] = from_float<T>(decltype(normalised)::value ? acc[k][q][e] : acc[k][q][e] * inv_sum);
              row[v0 + q * lanes] = y;
            }
        };
        if (one_chunk)
          store(std::true_type{});
        else if (last_chunk)
          store(std::false_type{});
      }
    }
    if (!has_pack[0]) break;
  }
  // In place the output LSE may be a part's: every lane of the item has read it before this.
  // Groups never straddle a warp, and every lane of the warp gets here.
  __syncwarp();
  if (lane == 0 && p.result.lse)
#pragma unroll
    for (int k = 0; k < kItems; ++k)
      if (items[k].active) p.result.lse[p.result.lse_offset(items[k].b, items[k].s, items[k].h)] = a[k].lse();
}

// The widest pack (at most 16 bytes of the wider type, at least one element) that every row start
// is aligned to: base addresses and the strides of dimensions that are stepped over, in the parts'
// element size and in the result's.
int pack_elements(const merge::MergeParams& p, int element_bytes) {
  int elements = 16 / element_bytes;
  const auto fits = [&](const merge::Layout& l, bool parts) {
    std::uint64_t bits = static_cast<std::uint64_t>(p.head_dim) * element_bytes | reinterpret_cast<std::uintptr_t>(l.out);
    const auto stride = [&](std::int64_t extent, std::int64_t stride_elements) {
      if (extent > 1) bits |= static_cast<std::uint64_t>(stride_elements) * element_bytes;
    };
    stride(p.batch, l.out_batch_stride);
    stride(p.tokens, l.out_token_stride);
    stride(p.heads, l.out_head_stride);
    if (parts) stride(p.parts, p.out_part_step);
    return (bits & static_cast<std::uint64_t>(elements * element_bytes - 1)) == 0;
  };
  while (elements > 1 && !(fits(p.first, true) && fits(p.second, true) && fits(p.result, false)))
    elements /= 2;
  return elements;
}

// A lane holds several packs of an item when that still fills the device with one wave of
// resident threads (2 CTAs per SM), so that an item's per-row work (its place, LSEs, weights, the
// division and the logarithm) is shared by fewer lanes: 8 packs (one part at a time) where a row
// has at least kLongRowPacks, else 4 (parts in chunks of 2). Fewer than 4 lanes per row lose: 8
// packs per lane on rows of 16 packs ran at 77-80 % of the copy ceiling against 89-92 %, and at
// 48 % on rows of 8 (bench/RESULTS.md, 2026-12-03 23:28). Smaller merges (decode) give a lane one
// pack, so that more threads share the few items.
constexpr int kWidePacks = 4, kLongRowWidePacks = 8, kLongRowPacks = 32;
constexpr int kResidentThreadsPerSm = 2 * kThreads;

template <class T>
cudaError_t launch(const merge::MergeParams& p, cudaStream_t stream) {
  const int elements = pack_elements(p, sizeof(T));
  const int packs = p.head_dim / elements;
  const auto lanes_log2_for = [&](int packs_per_lane) {
    int log2 = 0;
    while ((1 << log2) * packs_per_lane < packs && log2 < 5) ++log2;
    return log2;
  };
  const bool long_rows = packs >= kLongRowPacks;
  const int wide_lanes_log2 = lanes_log2_for(long_rows ? kLongRowWidePacks : kWidePacks);
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const bool wide = p.items() * (std::int64_t(1) << wide_lanes_log2) >=
                    std::int64_t(multiprocessors(device)) * kResidentThreadsPerSm;
  const int lanes_log2 = wide ? wide_lanes_log2 : lanes_log2_for(1);
  const int groups = kThreads >> lanes_log2;
  const bool heads_fastest = std::abs(p.result.out_head_stride) <= std::abs(p.result.out_token_stride);
  // Eight (part, item, pack) loads in flight per thread whatever the number of parts.
  const auto run = [&](auto kernel, int items_per_group) {
    const std::int64_t blocks = (p.items() + std::int64_t(groups) * items_per_group - 1) / (std::int64_t(groups) * items_per_group);
    if (blocks > 0x7fffffff) return false;
#if defined(BSATTN_GPU_HOST_EMULATION)  // tests/gpu/emulation: the kernel's logic on the host
    emulate_launch(kernel, dim3(static_cast<unsigned>(blocks)), kThreads, 0, p, lanes_log2, heads_fastest);
#else
    kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(p, lanes_log2, heads_fastest);
#endif
    return true;
  };
  const auto run_width = [&](auto width) {
    constexpr int kElems = decltype(width)::value;
    if (wide && long_rows) return run(merge_states_kernel<T, kElems, 1, 1, kLongRowWidePacks>, 1);
    if (wide) return run(merge_states_kernel<T, kElems, 2, 1, kWidePacks>, 1);
    if (p.parts <= 2) return run(merge_states_kernel<T, kElems, 2, 4, 1>, 4);
    if (p.parts <= 4) return run(merge_states_kernel<T, kElems, 4, 2, 1>, 2);
    return run(merge_states_kernel<T, kElems, 8, 1, 1>, 1);
  };
  bool launched = false;
  constexpr int kWidest = 16 / static_cast<int>(sizeof(T));
  switch (elements) {
    case kWidest: launched = run_width(std::integral_constant<int, kWidest>{}); break;
    case kWidest / 2: launched = run_width(std::integral_constant<int, kWidest / 2>{}); break;
    case kWidest / 4: launched = run_width(std::integral_constant<int, kWidest / 4>{}); break;
    default:
      if constexpr (kWidest == 8) launched = run_width(std::integral_constant<int, 1>{});
      break;
  }
  if (!launched) return cudaErrorInvalidConfiguration;
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
