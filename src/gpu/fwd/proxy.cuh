// Proxy compensation in the forward kernel (SPEC §6), a compile-time policy of the kernel
// (forward_kernel_ws<..., kProxy>). Route preparation ends a row with its proxy records, one per
// unselected eligible KV block j (or block of the explicit set); the kernel takes them kBlockN at
// a time as one more pipeline step after the exact routes:
// * loader: the step's K and V summary rows are gathered into a K and a V stage by cp.async
//   (gather_rows: produce_rows' layout, under an L2 evict_last policy), row c being record c's
//   block (the step's block indices read up front, one coalesced load per warp and 32 records);
// * consumers: the same S = Q K^T and O += P V GEMMs as an exact route. In the softmax a column is
//   -inf unless it holds a record the row's Q unit takes (columns past the records, blocks proxied
//   for another unit), and the row sum counts column c with weight n_c, the block's in-range
//   tokens: P = exp(s - m) multiplies the summed V as it is, so numerator += p * v_summary and
//   denominator += p * n_j, the LSE includes the proxy mass, and no V row is rescaled. (Biasing
//   the score by ln n_j instead would need V / n_j: a register pass over every gathered V row in
//   the loader rather than a plain cp.async, and one more rounding of V.)
#pragma once
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/softmax.cuh"

namespace bsattn::gpu::fwd {

// Named barrier of the loader warps (0-9 are the kernel's: kernel_ws.cuh).
constexpr int kLoaderBarrier = 10;

// Summary rows of one (sequence, KV head) for one proxy step: row c is the summary of the step's
// record c. Each loader warp holds the step's block indices, lane L record 32 w + L's in
// block[w], read with one coalesced load per word before the step's copies; reading a record
// per copied row instead put a dependent load in front of every row's cp.async (11-22 round
// trips per operand and step). Every lane calls it for every row (it shuffles within the warp).
template <class Element, int kWords>
struct SummaryRows {
  const Element* head;  // block 0's summary of this sequence and KV head
  std::int64_t block_stride;
  int block[kWords];
  __device__ __forceinline__ const Element* operator()(int c, bool valid) const {
    int j = 0;
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) {  // the word by compares: an indexed one would live in local memory
      const int v = __shfl_sync(0xffffffffu, block[w], c % 32);
      if (c / 32 == w) j = v;
    }
    return valid ? head + j * block_stride : head;
  }
};

// An L2 policy that keeps lines ahead of normally cached ones (createpolicy evict_last).
__device__ __forceinline__ std::uint64_t l2_evict_last() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Rows [0, kBlockN) of one proxy step's K or V stage from the summaries, 16 bytes per thread and
// copy (the layout of produce_rows), rows at or past n_valid zero-filled. The copies read under
// an evict_last policy: a head's summaries (256 KB at nKB = 512, D = 128) are read again by each
// of its Q tiles, which run microseconds apart while K/V tokens stream through L2 at several
// TB/s, so that with normal eviction the gathers would mostly go to memory.
template <class T, bool kIsV, int kWords>
__device__ __forceinline__ void gather_rows(typename T::SharedStorage& st,
                                            const SummaryRows<typename T::Element, kWords>& rows, int n_valid,
                                            int stage, int ptid, std::uint64_t policy) {
  constexpr int kChunks = T::kHeadDim / 8, kRowsPerStep = kLoaderThreads / kChunks;
  static_assert(kLoaderThreads % kChunks == 0, "whole rows per step");
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutVt{});
  const int d = (ptid % kChunks) * 8;
#pragma unroll 2
  for (int n0 = 0; n0 < T::kBlockN; n0 += kRowsPerStep) {
    const int n = n0 + ptid / kChunks;
    const bool valid = n < n_valid;
    const auto* src = rows(n, valid) + d;
    if (n < T::kBlockN) {
      void* dst = kIsV ? static_cast<void*>(&sVt(d, n, stage)) : static_cast<void*>(&sK(n, d, stage));
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(
                       static_cast<unsigned>(__cvta_generic_to_shared(dst))),
                   "l"(src), "r"(valid ? 16 : 0), "l"(policy)
                   : "memory");
    }
  }
}

// Arrives on `bar` once this thread's earlier cp.async copies have landed, raising the pending
// count first: the phase stays open until they land, without taking one of its arrivals.
__device__ __forceinline__ void cp_async_arrive_pending(std::uint64_t* bar) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(s) : "memory");
}

// The proxy steps of one work tile, after its exact routes, by all kLoaderThreads loader threads
// (ptid). `tma`: the stage full barriers expect one arrival (the TMA issuer's), and the exact
// routes were issued by the first loader thread or warp alone; the loader barrier then makes the
// others wait until its stage waits are done (so every thread waits on the same phases), and
// each step's copies keep the phase open (cp_async_arrive_pending) until thread 0's one arrival
// after a second loader barrier. Without TMA each thread arrives as for K/V tokens.
template <class T>
__device__ __forceinline__ void load_proxy_steps(const Tile& tile, bool tma, const AttentionParams& a,
                                                 typename T::SharedStorage& st,
                                                 PipelineBarriers<T::kStages, T::kWarpgroups>& bars, int ptid) {
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kStages = T::kStages;
  const int steps = tile.count - tile.exact;
  if (steps <= 0) return;  // the same for every loader thread: they read one slot
  if (tma) barrier_sync(kLoaderBarrier, kLoaderThreads);
  const Element* k_head = static_cast<const Element*>(a.k_summary) + tile.b * a.summary_batch_stride +
                          tile.hkv * a.summary_head_stride;
  const Element* v_head = static_cast<const Element*>(a.v_summary) + tile.b * a.v_summary_batch_stride +
                          tile.hkv * a.v_summary_head_stride;
  constexpr int kWords = kBlockN / 32;
  const std::uint64_t policy = l2_evict_last();
  const auto gather = [&](auto is_v, const SummaryRows<Element, kWords>& rows, std::uint64_t* full,
                          std::uint64_t* empty, int stage, int phase, int n_valid) {
    Barrier::wait(&empty[stage], phase ^ 1);
    gather_rows<T, decltype(is_v)::value>(st, rows, n_valid, stage, ptid, policy);
    if (tma) {
      cp_async_arrive_pending(&full[stage]);
      barrier_sync(kLoaderBarrier, kLoaderThreads);  // every thread's pending arrival is registered
      if (ptid == 0) Barrier::arrive(&full[stage]);
    } else {
      cp_async_arrive_noinc(&full[stage]);
    }
  };
  const int lane = ptid % 32;
  for (int k = 0; k < steps; ++k) {
    const int j = tile.first + tile.exact + k, stage = j % kStages, phase = (j / kStages) & 1;
    const route::Route* records = tile.routes + tile.exact + k * kBlockN;
    const int n_valid = min(kBlockN, tile.proxies - k * kBlockN);  // rows past it are zero-filled
    // Loaded before the K stage wait, under which their latency passes.
    SummaryRows<Element, kWords> rows{k_head, a.summary_block_stride, {}};
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) rows.block[w] = 32 * w + lane < n_valid ? records[32 * w + lane].index : 0;
    gather(std::false_type{}, rows, bars.full_k, bars.empty_k, stage, phase, n_valid);
    rows.head = v_head;
    rows.block_stride = a.v_summary_block_stride;
    gather(std::true_type{}, rows, bars.full_v, bars.empty_v, stage, phase, n_valid);
  }
}

// Row-sum weight of a proxy column: the block's in-range tokens. Every block has block_kv but the
// sequence's last one, which may be short; being the highest block, it can only be the row's
// last record, so at most one column of a row differs (proxy_softmax corrects it after the step).
struct BlockTokenWeight {
  static constexpr bool kUnit = false;
  float tokens;
  __device__ __forceinline__ float operator()(int) const { return tokens; }
};

// Softmax of proxy step `step` (>= tile.exact) of this warpgroup's score tile s (rowcol view, c
// its coordinates): masks the columns the rows do not take, then the weighted online softmax.
// A warp's 16 rows lie in one Q unit (unit_m >= 16), so the warp builds the visibility of the
// step's kBlockN columns for its unit by ballot, from one record read per lane and 32 columns
// (a record read per element instead kept 32 loads in flight and spilled). The word of a column
// is picked by compares, not by indexing, which would put the words in local memory.
template <int kBlockN, class TS, class TC, class Softmax, int kRows>
__device__ __forceinline__ void proxy_softmax(TS& s, const TC& c, const Tile& tile, int step, int block_kv,
                                              int tile_row0, int unit_m, Softmax& softmax,
                                              float (&rescale)[kRows]) {
  constexpr int kWords = kBlockN / 32;
  const int first = (step - tile.exact) * kBlockN;
  const route::Route* records = tile.routes + tile.exact + first;
  const int n_valid = min(kBlockN, tile.proxies - first);
  const int unit = (tile_row0 + get<0>(c(0, 0))) / unit_m;
  const int lane = threadIdx.x % 32;
  unsigned visible[kWords];
  CUTE_UNROLL
  for (int w = 0; w < kWords; ++w) {
    const int col = 32 * w + lane;
    const unsigned rows = col < n_valid ? records[col].rows : 0u;
    visible[w] = __ballot_sync(0xffffffffu, (rows >> unit) & 1u);
  }
  CUTE_UNROLL
  for (int j = 0; j < size<1>(s); ++j) {
    const int col = get<1>(c(0, j));
    unsigned word = visible[0];
    CUTE_UNROLL
    for (int w = 1; w < kWords; ++w)
      if (col >= 32 * w) word = visible[w];
    if (!((word >> (col % 32)) & 1u)) {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) s(i, j) = -INFINITY;
    }
  }
  softmax.step(s, rescale, BlockTokenWeight{static_cast<float>(block_kv)});
  const int last = tile.proxies - 1 - first;  // the row's last record, as a column of this step
  if (last < kBlockN) {
    const int tokens = tile.si.seqlen_kv - records[last].index * block_kv;
    if (tokens < block_kv) {  // a short last block: its column counts `tokens`, not block_kv
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j)
        if (get<1>(c(0, j)) == last) {
          CUTE_UNROLL
          for (int i = 0; i < kRows; ++i) softmax.row_sum[i] += static_cast<float>(tokens - block_kv) * s(i, j);
        }
    }
  }
}

}  // namespace bsattn::gpu::fwd
