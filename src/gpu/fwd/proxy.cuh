// Proxy compensation in the forward kernel (SPEC §6), a compile-time policy of the kernel
// (forward_kernel_ws<..., kProxy>). Route preparation ends a row with its proxy records, one per
// unselected eligible KV block j (or block of the explicit set), in block order. The kernel takes
// them as windows: window w is the kBlockN summary rows of blocks [w kBlockN, (w + 1) kBlockN),
// and a tile's proxy steps are the windows from its first proxy record's to its last's, one
// pipeline step each after the exact routes (Tile::window0, Tile::count):
// * loader: a window's K and V summary rows are one more K and V tile, loaded like a route's
//   tokens (one bulk tensor copy per operand from the summary maps, or the cp.async rows copy);
// * consumers: the same S = Q K^T and O += P V GEMMs as an exact route. In the softmax a column
//   is -inf unless its block has a record the row's Q unit takes (selected blocks, blocks past
//   the sequence or outside the eligible set, blocks proxied for another unit), and the row sum
//   counts column c with weight n_c, the block's in-range tokens: P = exp(s - m) multiplies the
//   summed V as it is, so numerator += p * v_summary and denominator += p * n_j, the LSE
//   includes the proxy mass, and no V row is rescaled. (Biasing the score by ln n_j instead would
//   need V / n_j: a register pass over every loaded V row rather than a plain copy, and one more
//   rounding of V.)
// Design history: the records' summary rows were first gathered into the stages row by row, by
// the 96 cp.async loader threads; +36-58 % over the exact run where the extra GEMM work is 4-9 %
// (bench/RESULTS.md). A window costs at most one step more per tile than packed records at the
// densities this serves, and is a plain tile load.
#pragma once
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/softmax.cuh"

namespace bsattn::gpu::fwd {

// The proxy windows of one work tile, after its exact routes, by the threads that issued those:
// with TMA the first one (ptid 0) copies each operand's window from the summary maps (rows past
// the tensor zero-filled; rows of blocks past a shorter sequence are finite data, as K/V tokens
// past it, that the softmax removes; route pairs: two boxes of kRouteN rows); with cp.async the
// kLoaderThreads threads copy the rows, zero-filled past the sequence's blocks.
template <class T>
__device__ __forceinline__ void load_proxy_windows(const Tile& tile, bool tma, const AttentionParams& a,
                                                   const LaunchDescriptors& desc, typename T::SharedStorage& st,
                                                   PipelineBarriers<T::kStages, T::kWarpgroups>& bars, int ptid) {
  using Element = typename T::Element;
  constexpr int kBlockN = T::kBlockN, kStages = T::kStages, kRoutesPerStep = T::kRoutesPerStep;
  const int first_window = tile.first + exact_step_count<kRoutesPerStep>(tile);
  if (tma && !a.route.paged) return;  // load_tile_routes copied them with the routes
  if (tma) {  // paged K/V: the loader warp's first lane
    if (ptid != 0) return;
    for (int j = first_window; j < tile.first + tile.count; ++j) {
      const PipelineSlot<kStages> slot(j);
      const int stage = slot.stage, phase = slot.phase;
      const int row = proxy_window_row<kBlockN, kRoutesPerStep>(tile, j - tile.first);
      tma_stage_load<T>(st.k, &desc.k_summary, bars.full_k, bars.empty_k, stage, phase, row, tile.hkv, tile.b,
                        row + T::kRouteN);
      tma_stage_load<T>(st.v, &desc.v_summary, bars.full_v, bars.empty_v, stage, phase, row, tile.hkv, tile.b,
                        row + T::kRouteN);
    }
    return;
  }
  const ContiguousRows<Element> k_rows{static_cast<const Element*>(a.k_summary) + tile.b * a.summary_batch_stride +
                                           tile.hkv * a.summary_head_stride,
                                       a.summary_block_stride};
  const ContiguousRows<Element> v_rows{static_cast<const Element*>(a.v_summary) +
                                           tile.b * a.v_summary_batch_stride + tile.hkv * a.v_summary_head_stride,
                                       a.v_summary_block_stride};
  for (int j = first_window; j < tile.first + tile.count; ++j) {
    const PipelineSlot<kStages> slot(j);
    const int stage = slot.stage, phase = slot.phase;
    const int row = proxy_window_row<kBlockN, kRoutesPerStep>(tile, j - tile.first);
    const int n_valid = tile.si.kv_blocks - row;
    cp_async_stage_load<T, false>(st, k_rows, bars.full_k, bars.empty_k, stage, phase, row, n_valid, ptid);
    cp_async_stage_load<T, true>(st, v_rows, bars.full_v, bars.empty_v, stage, phase, row, n_valid, ptid);
  }
}

// Row-sum weight of a proxy column: the block's in-range tokens. Every block has block_kv but the
// sequence's last one, which may be short (proxy_softmax corrects its column after the step).
struct BlockTokenWeight {
  static constexpr bool kUnit = false;
  float tokens;
  __device__ __forceinline__ float operator()(int) const { return tokens; }
};

// The proxy records that can lie in the window of the tile's next proxy step: kBlockN from the
// cursor (the first record not in an earlier window; a window holds at most kBlockN records, one
// per block), record cursor + 32 w + L in lane L's records[w], past the row's records one past
// every window. The consumers read them before the step's S GEMM is issued, as an exact route's
// record: read in the softmax they put an L2 round trip on every proxy step.
template <int kBlockN>
struct ProxyRecords {
  static constexpr int kWords = kBlockN / 32;
  route::Route records[kWords];
  __device__ __forceinline__ ProxyRecords(const Tile& tile, int cursor) {
    const int end = tile.exact + tile.proxies, lane = threadIdx.x % 32;
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) {
      const int r = cursor + 32 * w + lane;
      records[w] = r < end ? tile.routes[r] : route::Route{1 << 30, 0, 0, 0, 0};
    }
  }
};

// Softmax of proxy step `step` (>= the exact steps) of this warpgroup's score tile s (rowcol view, c
// its coordinates) from its candidate records: masks the columns the rows do not take, then the
// weighted online softmax. `cursor` moves past the window's records (the steps come in order). A
// warp's 16 rows lie in one Q unit (unit_m >= 16), so the warp builds the visibility of the
// window's kBlockN columns for its unit: each candidate inside the window sets its column's bit
// by a warp OR. The word of a column is picked by compares, not by indexing, which would put the
// words in local memory.
template <int kBlockN, int kRoutesPerStep, class TS, class TC, class Softmax, int kRows>
__device__ __forceinline__ void proxy_softmax(TS& s, const TC& c, const Tile& tile, int step, int block_kv,
                                              int tile_row0, int unit_m, const ProxyRecords<kBlockN>& candidates,
                                              int& cursor, Softmax& softmax, float (&rescale)[kRows]) {
  constexpr int kWords = kBlockN / 32;
  const int row0 = proxy_window_row<kBlockN, kRoutesPerStep>(tile, step);
  const int unit = (tile_row0 + get<0>(c(0, 0))) / unit_m;
  const route::Route(&records)[kWords] = candidates.records;
  unsigned visible[kWords];
  CUTE_UNROLL
  for (int w = 0; w < kWords; ++w) visible[w] = 0u;
  CUTE_UNROLL
  for (int w = 0; w < kWords; ++w) {
    const int col = records[w].index - row0;  // >= 0: records before the window were taken
    const bool in_window = col < kBlockN;
    cursor += __popc(__ballot_sync(0xffffffffu, in_window));
    const unsigned bit = in_window && ((records[w].rows >> unit) & 1u) ? 1u << (col % 32) : 0u;
    CUTE_UNROLL
    for (int v = 0; v < kWords; ++v) visible[v] |= __reduce_or_sync(0xffffffffu, col / 32 == v ? bit : 0u);
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
  const int last_block = tile.si.kv_blocks - 1;
  const int tokens = tile.si.seqlen_kv - last_block * block_kv;
  const int last = last_block - row0;  // the sequence's last block, as a column of this window
  if (tokens < block_kv && last >= 0 && last < kBlockN) {  // a short last block counts `tokens`, not block_kv
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j)
      if (get<1>(c(0, j)) == last) {
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i) softmax.row_sum[i] += static_cast<float>(tokens - block_kv) * s(i, j);
      }
  }
}

}  // namespace bsattn::gpu::fwd
