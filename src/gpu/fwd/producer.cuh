// Producer side of the forward kernel: the K/V load pipeline (stage barriers, bulk tensor
// copies or cp.async), the Q loads and the host-side encoding of the tensor maps.
#pragma once
#include <cuda.h>

#include <cutlass/arch/barrier.h>

#include "bsattn/attention_params.hpp"
#include "gpu/attention.hpp"
#include "gpu/fwd/decode.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/tensor_map_memo.hpp"
#include "gpu/fwd/traits.cuh"

namespace bsattn::gpu::fwd {

// Stage barriers of the K and V pipelines, and of each consumer warpgroup's Q buffer.
template <int kStages, int kWarpgroups>
struct PipelineBarriers {
  alignas(8) std::uint64_t full_k[kStages], empty_k[kStages], full_v[kStages], empty_v[kStages];
  std::uint64_t full_q[kWarpgroups], empty_q[kWarpgroups];
};

// Stage and phase parity of pipeline position j (steps counted from the CTA's first, never
// negative). Unsigned: with a power-of-two stage count a mask and a shift, not a signed division
// and remainder (five uniform instructions per wait, twice a step).
// A loop walking the positions one by one carries the slot instead (next()): two uniform
// instructions per step rather than the mask and shift per wait and release.
template <int kStages>
struct PipelineSlot {
  int stage, phase;
  __device__ __forceinline__ explicit PipelineSlot(int j)
      : stage(static_cast<int>(static_cast<unsigned>(j) % kStages)),
        phase(static_cast<int>(static_cast<unsigned>(j) / kStages & 1u)) {}
  // The slot of position j + 1.
  __device__ __forceinline__ PipelineSlot next() const {
    PipelineSlot n = *this;
    if constexpr (kStages == 2) {  // the phase flips after stage 1
      n.phase ^= n.stage;
      n.stage ^= 1;
    } else if (++n.stage == kStages) {
      n.stage = 0;
      n.phase ^= 1;
    }
    return n;
  }
};

// Threads of the cp.async K/V loader (producer warps 0-2; warp 3 is the tile warp).
constexpr int kLoaderThreads = 96;

// cp.async copy of rows [n_begin, n_end) of one K or V tile by kThreads threads (16 bytes each
// per step), rows at or past n_valid zero-filled. `row(kv, valid)` is the address of token kv of
// the sequence (the tensor's base when not valid); every lane of a warp calls it in every step
// (the paged form shuffles within the warp). The caller arrives on the stage's barrier.
template <class T, bool kIsV, int kThreads, class RowAddress>
__device__ __forceinline__ void produce_rows(typename T::SharedStorage& st, const RowAddress& row, int k0, int n_begin,
                                             int n_end, int n_valid, int stage, int ptid) {
  constexpr int kChunks = T::kHeadDim / 8;
  constexpr int kRowsPerStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0, "whole rows per step");
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutVt{});
  const int d = (ptid % kChunks) * 8;
#pragma unroll 2
  for (int n0 = n_begin; n0 < n_end; n0 += kRowsPerStep) {
    const int n = n0 + ptid / kChunks;
    const bool in_range = n < n_end;
    const bool valid = in_range && n < n_valid;
    const typename T::Element* src = row(k0 + n, valid) + d;
    if (in_range) {
      if constexpr (kIsV) cp_async_16(&sVt(d, n, stage), src, valid);
      else cp_async_16(&sK(n, d, stage), src, valid);
    }
  }
}

// Token rows of one K or V head of a contiguous (batched or varlen) tensor.
template <class Element>
struct ContiguousRows {
  const Element* head;  // token 0 of the sequence, this KV head
  std::int64_t token_stride;
  __device__ __forceinline__ const Element* operator()(int kv, bool valid) const {
    return valid ? head + kv * token_stride : head;
  }
};

// Token rows of one K or V head of a page cache. Lane L of the loader warp holds the page id of
// the tile's page first_page + L (one block-table read per lane and route, only for the
// sequence's live pages); a row takes its page from that lane. Pages of at least 16 tokens
// (plan() checks) keep a tile within 32 pages.
template <class Element>
struct PagedRows {
  const Element* head;  // page 0, token 0, this KV head
  std::int64_t page_stride, token_stride;
  int page_size, first_page, lane_page;
  __device__ __forceinline__ const Element* operator()(int kv, bool valid) const {
    const int page = __shfl_sync(0xffffffffu, lane_page, (kv / page_size - first_page) & 31);
    return valid ? head + page * page_stride + (kv % page_size) * token_stride : head;
  }
};

// Bulk tensor (TMA) maps of Q, K, V and O as 4-D tensors (D, tokens, heads, batch; a paged cache
// as (D, tokens of a page, heads, pages)). `tma` 0: the producer falls back to cp.async
// (per-token addressing); `tma_out` 0: no map of O (a 4-byte output type, or one TMA cannot
// address), the epilogue copies with its threads. A problem with proxy routes maps its summaries
// too (K/V tiles of summary rows: proxy.cuh). Paged: the K/V maps copy boxes of
// `page_box_rows` tokens (each inside one page); `kv_pages` is the first page id past the cache.
// A decode kernel's Q and O boxes are {64, T tokens, P heads} (decode.cuh).
struct LaunchDescriptors {
  CUtensorMap q, k, v, o;
  CUtensorMap k_summary, v_summary;  // proxy kernels: (D, blocks, heads, batch), boxes of a K/V tile's rows
  int tma, tma_out;
  int page_box_rows, kv_pages;
  DecodeGeometry decode;
  std::uint64_t* timeline;  // measurement builds only (timeline.cuh); else null
};

// kEvictFirst: the box is read once (a decode step's K/V: query heads packed, splits disjoint), so
// it is marked evict-first in L2 rather than pushing out what the next launch reads again: the
// kernel's code and parameters, which a short step fetches cold.
template <bool kEvictFirst = false>
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, std::uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  if constexpr (kEvictFirst) {
    asm volatile(
        "{\n.reg .b64 policy;\ncreatepolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, "
        "%4, %5, %6}], [%2], policy;\n}\n" ::"r"(s),
        "l"(reinterpret_cast<std::uint64_t>(map)), "r"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
        "[%2];\n" ::"r"(s),
        "l"(reinterpret_cast<std::uint64_t>(map)), "r"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
  }
}

// The same box into the same shared-memory offset of every CTA in `mask`, completing on the
// barrier at the same offset in each.
__device__ __forceinline__ void tma_load_4d_multicast(void* smem, const CUtensorMap* map, std::uint64_t* bar, int c0,
                                                      int c1, int c2, int c3, std::uint16_t mask) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5, %6}], [%2], %7;\n" ::"r"(s),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(mask)
      : "memory");
}

// One K or V tile of a step into `stage`: D/64 boxes of 64 x kBlockN (128-byte swizzle, the layout
// the wgmma descriptors read). With pair multicast this CTA loads its half of the tokens (boxes of
// 64 x kBlockN/2, 8 KB apart: the swizzle pattern is unchanged) into both CTAs of the pair. With
// route pairs (T::kRoutesPerStep 2) the halves are two routes' tokens, from `token` and `token2`.
template <class T>
__device__ __forceinline__ void load_operand(typename T::Element* base, const CUtensorMap* map, std::uint64_t* bar,
                                             int stage, int token, int hkv, int batch, int token2 = 0) {
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  CUTE_UNROLL
  for (int c = 0; c < kHeadDim / 64; ++c) {
    typename T::Element* dst = base + (stage * kHeadDim + c * 64) * kBlockN;
    if constexpr (T::kPairMulticast) {
      const int half = static_cast<int>(cute::block_rank_in_cluster()) * (kBlockN / 2);
      tma_load_4d_multicast(dst + half * 64, map, bar, c * 64, token + half, hkv, batch, 0x3);
    } else if constexpr (T::kRoutesPerStep == 2) {
      tma_load_4d(dst, map, bar, c * 64, token, hkv, batch);
      tma_load_4d(dst + T::kRouteN * 64, map, bar, c * 64, token2, hkv, batch);
    } else {
      tma_load_4d<T::kDecode>(dst, map, bar, c * 64, token, hkv, batch);
    }
  }
}

// One operand (K or V) of a pipeline step into `stage` by TMA once the consumers released it: rows
// [row, row + kBlockN) of `map` (load_operand; route pairs: kRouteN rows from `row` and from
// `row2`), completing on the stage's full barrier.
template <class T>
__device__ __forceinline__ void tma_stage_load(typename T::Element* tiles, const CUtensorMap* map, std::uint64_t* full,
                                               std::uint64_t* empty, int stage, int phase, int row, int hkv,
                                               int batch, int row2 = 0) {
  cutlass::arch::ClusterBarrier::wait(&empty[stage], phase ^ 1);
  // The whole tile: with pair multicast both halves land here.
  arrive_expect_tx(&full[stage], T::kBlockN * T::kHeadDim * sizeof(typename T::Element));
  load_operand<T>(tiles, map, &full[stage], stage, row, hkv, batch, row2);
}

// The same by the kLoaderThreads cp.async threads (ptid): rows k0 + [0, kBlockN) of `rows`
// (produce_rows), zero-filled from n_valid on; each thread arrives once its copies have landed.
template <class T, bool kIsV, class RowAddress>
__device__ __forceinline__ void cp_async_stage_load(typename T::SharedStorage& st, const RowAddress& rows,
                                                    std::uint64_t* full, std::uint64_t* empty, int stage, int phase,
                                                    int k0, int n_valid, int ptid) {
  cutlass::arch::ClusterBarrier::wait(&empty[stage], phase ^ 1);
  produce_rows<T, kIsV, kLoaderThreads>(st, rows, k0, 0, T::kBlockN, n_valid, stage, ptid);
  cp_async_arrive_noinc(&full[stage]);
}

// Issues a tile's `steps` pipeline steps with K one step ahead of V: K(0), then K(i + 1) before
// V(i), the order the consumers take them in (S of step i + 1 is issued before PV of step i).
// K(i + 1)'s stage frees after S(i - 1), V(i)'s only after PV(i - 2): in K(i), V(i) order K(i + 1)
// waited behind V(i)'s later stage, and with two stages reached the consumers late (on the paged
// path also behind the next route's record and block-table reads). locate(i) gives what step i's
// copies need, read one step ahead of its V; load_k / load_v(i, located) wait and issue.
template <class Locate, class LoadK, class LoadV>
__device__ __forceinline__ void stream_k_ahead_of_v(int steps, const Locate& locate, const LoadK& load_k,
                                                    const LoadV& load_v) {
  if (steps <= 0) return;
  auto now = locate(0);
  load_k(0, now);
  for (int i = 0; i < steps; ++i) {
    const auto ahead = i + 1 < steps ? locate(i + 1) : now;
    if (i + 1 < steps) load_k(i + 1, ahead);
    load_v(i, now);
    now = ahead;
  }
}

// Paged K/V by TMA, run by the loader warp (ptid = lane). A tile is kBlockN / page_box_rows boxes,
// each inside one page; lane g copies box g from the page the block table gives (lanes read their
// entries in parallel). A box past the sequence end reads page kv_pages, past the cache: TMA fills
// it with zeros. The box holding the sequence end is copied by the whole warp with cp.async,
// zero-filled past the end: the cache's tokens there are anything, and a NaN in V would reach the
// row through a zero P. On that route lane 0 expects the TMA bytes first and arrives once the
// warp's cp.async copies have landed, so the stage completes when both have; on every other
// route it arms and arrives at once.
template <class T>
__device__ __forceinline__ void load_paged_routes(const Tile& tile, const AttentionParams& a,
                                                  const LaunchDescriptors& desc, typename T::SharedStorage& st,
                                                  PipelineBarriers<T::kStages, T::kWarpgroups>& bars, int lane) {
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kStages = T::kStages;
  const route::RouteParams& p = a.route;
  const int box_rows = desc.page_box_rows, boxes = kBlockN / box_rows;
  const int hkv = tile.hkv, page_size = a.page_size;
  const std::int32_t* table = a.block_table + tile.b * a.block_table_stride;
  const int r0 = lane * box_rows;  // this lane's box
  // A CTA pair shares the tile: each CTA multicasts the boxes of its half into both (the box rows
  // are at most kBlockN / 2), and copies the sequence-end box into its own stage itself.
  const int half = T::kPairMulticast ? static_cast<int>(cute::block_rank_in_cluster()) * (kBlockN / 2) : 0;
  const bool my_box = lane < boxes && (!T::kPairMulticast || (r0 >= half && r0 < half + kBlockN / 2));
  const auto load = [&](auto is_v, Element* tiles, const CUtensorMap* map, const void* cache,
                        std::int64_t head_stride, std::int64_t page_stride, std::int64_t token_stride,
                        std::uint64_t* full, std::uint64_t* empty, int stage, int phase, int k0, int n_valid,
                        int page, int token, int tail_box) {
    Barrier::wait(&empty[stage], phase ^ 1);
    constexpr unsigned kTileBytes = kBlockN * kHeadDim * sizeof(Element);
    // Only the issue is left after the wait: the loader's latency from a stage freeing to its
    // copies is on paged prefill's critical path (bench/RESULTS.md, 2026-12-04 17:2x). Without a
    // sequence-end box lane 0 arms and arrives at once (its arrival may follow or precede the
    // other lanes' bytes: the phase needs both); with one it arrives after the warp's copies.
    if (tail_box < 0) {
      if (lane == 0) arrive_expect_tx(&full[stage], kTileBytes);
    } else {
      if (lane == 0) expect_tx(&full[stage], kTileBytes - box_rows * kHeadDim * sizeof(Element));
      __syncwarp();
    }
    if (my_box && lane != tail_box) {
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / 64; ++c) {
        Element* dst = tiles + (stage * kHeadDim + c * 64) * kBlockN + r0 * 64;
        if constexpr (T::kPairMulticast) tma_load_4d_multicast(dst, map, &full[stage], c * 64, token, hkv, page, 0x3);
        else tma_load_4d<T::kDecode>(dst, map, &full[stage], c * 64, token, hkv, page);
      }
    }
    if (tail_box >= 0) {
      const int t0 = tail_box * box_rows, kv = k0 + t0;
      // The head's rows are addressed here, from the slot by a volatile read: addressed before the
      // route loop (as the compiler hoists them otherwise), the K and V heads' 64-bit offsets stayed
      // live across it and spilled in the 40-register producer of two CTAs per SM (proxy kernels).
      const std::int64_t head = *reinterpret_cast<const volatile int*>(&tile.hkv) * head_stride;
      const Element* rows = static_cast<const Element*>(cache) + head +
                            static_cast<std::int64_t>(table[kv / page_size]) * page_stride +
                            (kv % page_size) * token_stride;
      produce_rows<T, decltype(is_v)::value, 32>(st, ContiguousRows<Element>{rows, token_stride}, -t0, t0,
                                                 t0 + box_rows, n_valid, stage, lane);
      cp_async_wait_all();
      __syncwarp();
      if (lane == 0) Barrier::arrive(&full[stage]);
    }
  };
  // Route i's boxes: this lane's page and token, and the box holding the sequence end (-1: none).
  struct RouteBoxes {
    int k0, n_valid, page, token, tail_box;
  };
  const auto locate = [&](int i) {
    RouteBoxes r;
    r.k0 = route_index(tile, i) * p.tile_n;
    r.n_valid = min(p.tile_n, tile.si.seqlen_kv - r.k0);
    const int rows = lane < boxes ? max(0, min(box_rows, r.n_valid - r0)) : 0;
    r.page = rows == box_rows ? table[(r.k0 + r0) / page_size] : desc.kv_pages;
    r.token = (r.k0 + r0) % page_size;
    r.tail_box = __ffs(__ballot_sync(0xffffffffu, rows > 0 && rows < box_rows)) - 1;
    return r;
  };
  const auto load_k = [&](int i, const RouteBoxes& r) {
    const PipelineSlot<kStages> slot(tile.first + i);
    load(std::false_type{}, st.k, &desc.k, a.k, a.k_head_stride, a.k_batch_stride, a.k_token_stride, bars.full_k,
         bars.empty_k, slot.stage, slot.phase, r.k0, r.n_valid, r.page, r.token, r.tail_box);
  };
  const auto load_v = [&](int i, const RouteBoxes& r) {
    const PipelineSlot<kStages> slot(tile.first + i);
    load(std::true_type{}, st.v, &desc.v, a.v, a.v_head_stride, a.v_batch_stride, a.v_token_stride, bars.full_v,
         bars.empty_v, slot.stage, slot.phase, r.k0, r.n_valid, r.page, r.token, r.tail_box);
  };
  stream_k_ahead_of_v(tile.exact, locate, load_k, load_v);
}

// Streams the K and V tiles of one work tile's exact routes into the stages, from the tile's
// pipeline position on; with TMA and contiguous K/V a proxy kernel's windows too (otherwise
// load_proxy_windows follows: proxy.cuh). TMA: thread 0 alone (paged: the loader warp); cp.async:
// the kLoaderThreads loader threads (ptid).
template <class T, bool kProxy = false>
__device__ __forceinline__ void load_tile_routes(const Tile& tile, bool tma, const AttentionParams& a,
                                                 const LaunchDescriptors& desc, typename T::SharedStorage& st,
                                                 PipelineBarriers<T::kStages, T::kWarpgroups>& bars, int ptid) {
  using Element = typename T::Element;
  constexpr int kStages = T::kStages;
  const route::RouteParams& p = a.route;
  const int hkv = tile.hkv;
  if (tma && p.paged) {
    load_paged_routes<T>(tile, a, desc, st, bars, ptid);
  } else if (tma) {
    // Tokens past the tensor are zero-filled; tokens past the sequence but inside the tensor are
    // finite data that the route mask removes.
    // A proxy kernel's windows follow in the same loop (one loop with the two maps: a second one
    // spilled in the 40-register producer).
    // Route pairs: a step without a second route fills its second half from before the tensor's
    // first token (zeros: a stale stage could hold NaN, which a zero P would still spread).
    const int tok0 = p.varlen_kv ? static_cast<int>(tile.si.kv_base) : 0;
    const int bc = p.varlen_kv ? 0 : tile.b;
    const int exact_steps = exact_step_count<T::kRoutesPerStep>(tile);
    // Step i's rows: its route's first token (route pairs: and the second route's), or a window's
    // first summary row (route pairs: and its second half's), and the map's batch coordinate.
    struct StepRows {
      int row, row2, batch;
      bool window;
    };
    const auto locate = [&](int i) {
      StepRows s;
      s.window = kProxy && i >= exact_steps;
      const int r = i * T::kRoutesPerStep;  // the step's first route
      s.row = s.window ? proxy_window_row<T::kBlockN, T::kRoutesPerStep>(tile, i)
                       : tok0 + route_index(tile, r) * p.tile_n;
      s.row2 = T::kRoutesPerStep == 1 ? 0
               : s.window             ? s.row + T::kRouteN
               : r + 1 < tile.exact   ? tok0 + route_index(tile, r + 1) * p.tile_n
                                      : -T::kRouteN;
      s.batch = s.window ? tile.b : bc;
      return s;
    };
    const auto load_k = [&](int i, const StepRows& s) {
      const PipelineSlot<kStages> slot(tile.first + i);
      tma_stage_load<T>(st.k, s.window ? &desc.k_summary : &desc.k, bars.full_k, bars.empty_k, slot.stage, slot.phase,
                        s.row, hkv, s.batch, s.row2);
    };
    const auto load_v = [&](int i, const StepRows& s) {
      const PipelineSlot<kStages> slot(tile.first + i);
      tma_stage_load<T>(st.v, s.window ? &desc.v_summary : &desc.v, bars.full_v, bars.empty_v, slot.stage, slot.phase,
                        s.row, hkv, s.batch, s.row2);
    };
    stream_k_ahead_of_v(tile.count, locate, load_k, load_v);
  } else {
    // One operand of a route into `stage`; each thread arrives once its own copies have landed.
    const auto load = [&](auto is_v, const auto& rows, std::uint64_t* full, std::uint64_t* empty, int stage,
                          int phase, int k0, int n_valid) {
      cp_async_stage_load<T, decltype(is_v)::value>(st, rows, full, empty, stage, phase, k0, n_valid, ptid);
    };
    const Element* k = static_cast<const Element*>(a.k);
    const Element* v = static_cast<const Element*>(a.v);
    if (p.paged) {
      const int live_pages = (tile.si.seqlen_kv + a.page_size - 1) / a.page_size;
      const std::int32_t* table = a.block_table + tile.b * a.block_table_stride;
      const int lane = ptid % 32;
      for (int i = 0; i < tile.exact; ++i) {
        const PipelineSlot<kStages> slot(tile.first + i);
        const int stage = slot.stage, phase = slot.phase;
        const int k0 = route_index(tile, i) * p.tile_n;
        const int n_valid = min(p.tile_n, tile.si.seqlen_kv - k0);
        const int first_page = k0 / a.page_size;
        const int lane_page = first_page + lane < live_pages ? table[first_page + lane] : 0;
        load(std::false_type{},
             PagedRows<Element>{k + hkv * a.k_head_stride, a.k_batch_stride, a.k_token_stride, a.page_size, first_page,
                                lane_page},
             bars.full_k, bars.empty_k, stage, phase, k0, n_valid);
        load(std::true_type{},
             PagedRows<Element>{v + hkv * a.v_head_stride, a.v_batch_stride, a.v_token_stride, a.page_size, first_page,
                                lane_page},
             bars.full_v, bars.empty_v, stage, phase, k0, n_valid);
      }
      return;
    }
    const ContiguousRows<Element> k_rows{
        k + a.kv_offset(tile.b, tile.si, 0, hkv, a.k_batch_stride, a.k_token_stride, a.k_head_stride), a.k_token_stride};
    const ContiguousRows<Element> v_rows{
        v + a.kv_offset(tile.b, tile.si, 0, hkv, a.v_batch_stride, a.v_token_stride, a.v_head_stride), a.v_token_stride};
    // Step i's stage: rows [h kRouteN, (h + 1) kRouteN) from the step's route h (one route per
    // step, or a pair), zeros where the row has no such route; each thread arrives once its copies
    // of the whole stage have landed.
    constexpr int kRouteN = T::kRouteN;
    const auto load_step = [&](auto is_v, const auto& rows, std::uint64_t* full, std::uint64_t* empty, int i) {
      const PipelineSlot<kStages> slot(tile.first + i);
      const int stage = slot.stage, phase = slot.phase;
      cutlass::arch::ClusterBarrier::wait(&empty[stage], phase ^ 1);
      CUTE_UNROLL
      for (int h = 0; h < T::kRoutesPerStep; ++h) {
        const int r = i * T::kRoutesPerStep + h;
        const int k0 = r < tile.exact ? route_index(tile, r) * p.tile_n : 0;
        const int n_valid = r < tile.exact ? min(p.tile_n, tile.si.seqlen_kv - k0) : 0;
        // Row n of the stage is token k0 - h kRouteN + n.
        produce_rows<T, decltype(is_v)::value, kLoaderThreads>(st, rows, k0 - h * kRouteN, h * kRouteN,
                                                               (h + 1) * kRouteN, h * kRouteN + n_valid, stage, ptid);
      }
      cp_async_arrive_noinc(&full[stage]);
    };
    // The exact routes' steps (a proxy kernel's windows follow: load_proxy_windows).
    const int steps = exact_step_count<T::kRoutesPerStep>(tile);
    for (int i = 0; i < steps; ++i) {
      load_step(std::false_type{}, k_rows, bars.full_k, bars.empty_k, i);
      load_step(std::true_type{}, v_rows, bars.full_v, bars.empty_v, i);
    }
  }
}

// The tile warp's Q load: every consumer warpgroup's 64 query rows of `tile` into its Q buffer
// once the warpgroup released the buffer (after the last S GEMM of its previous tile). TMA: lane
// 0 issues D/64 boxes of 64 x 64 per warpgroup (rows past the sequence are rows of the next
// sequence or zeros past the tensor: finite, and never stored); cp.async: the 32 lanes, rows past
// the sequence zero-filled, each lane arriving when its copies have landed. A tile without routes
// (`any_routes` false) loads nothing (the arrivals alone: the consumers wait for every tile's Q).
// `parity`: the tile's slot index (one Q load per tile, so phase t % 2).
template <class T>
__device__ __forceinline__ void load_q(const Tile& tile, int parity, bool tma, const AttentionParams& a,
                                       const LaunchDescriptors& desc, typename T::SharedStorage& st,
                                       PipelineBarriers<T::kStages, T::kWarpgroups>& bars, int pair_rank,
                                       bool any_routes) {
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kHeadDim = T::kHeadDim;
  const route::RouteParams& p = a.route;
  // Lane-dependent shared addresses from an opaque lane index: hoisted out of the tile loop, the
  // 40-register warp spilled them.
  const int lane = opaque_thread_index() % 32;
  if (tma) {
    if (lane != 0) return;
    CUTE_UNROLL
    for (int wg = 0; wg < T::kWarpgroups; ++wg) {
      Barrier::wait(&bars.empty_q[wg], parity ^ 1);
      if (!any_routes) {
        Barrier::arrive(&bars.full_q[wg]);
        continue;
      }
      arrive_expect_tx(&bars.full_q[wg], 64 * kHeadDim * sizeof(Element));
      const int token = (p.varlen_q ? static_cast<int>(tile.si.q_base) : 0) + tile.q0 + warpgroup_row0<T>(wg);
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / 64; ++c)
        tma_load_4d(st.q[wg] + c * 64 * 64, &desc.q, &bars.full_q[wg], c * 64, token,
                    warpgroup_head<T>(tile, wg, pair_rank), p.varlen_q ? 0 : tile.b);
    }
    return;
  }
  CUTE_UNROLL
  for (int wg = 0; wg < T::kWarpgroups; ++wg) {
    Barrier::wait(&bars.empty_q[wg], parity ^ 1);
    if (any_routes) {
      const int head = warpgroup_head<T>(tile, wg, pair_rank);
      const int row0 = tile.q0 + warpgroup_row0<T>(wg);
      const TileRows<T::kDecode> rows{desc.decode.tokens_log2};
      constexpr int kChunks = kHeadDim / 8, kRowsPerStep = 32 / kChunks;
      static_assert(kChunks <= 32 && 32 % kChunks == 0, "a warp covers whole rows");
      const Element* q = static_cast<const Element*>(a.q);
      const int d = (lane % kChunks) * 8;
      Tensor sQ = make_tensor(make_smem_ptr(st.q[wg]), typename T::SmemLayoutQ{});
#pragma unroll 2
      for (int r = lane / kChunks; r < 64; r += kRowsPerStep) {
        const int token = row0 + rows.token(r);
        const bool valid = token < tile.si.seqlen_q;
        cp_async_16(&sQ(r, d), valid ? q + a.q_offset(tile.b, tile.si, token, head + rows.head(r)) + d : q, valid);
      }
    }
    cp_async_arrive_noinc(&bars.full_q[wg]);
  }
}

// Encodes the Q, K, V and O tensor maps for this run (host only: no stream work, capturable).
// Returns false where TMA cannot address Q, K or V (strides or bases not 16-byte aligned, no
// driver entry point); the kernel then loads with cp.async. Sets maps.tma_out and, for paged K/V,
// the box rows (the largest of 128, 64, 32, 16 that divides the page size, the route tile width
// and kBlockN, at most kBlockN / 2 for a CTA pair, so a box never crosses a page) and the page
// count.
template <class T>
bool encode_maps(const AttentionParams& a, const TokenExtents& extents, LaunchDescriptors& maps) {
  // Memoised: a run on the same addresses and strides copies its maps (tensor_map_memo.hpp).
  const EncodeTiled encode = tensor_map_encoder();
  if (!encode) return false;
  static_assert(sizeof(typename T::Element) == 2, "16-bit elements");
  const auto one = [&](const void* base, std::int64_t bs, std::int64_t ts, std::int64_t hs, bool varlen,
                       std::int64_t tokens, int heads, std::int64_t batches, int rows, CUtensorMap& map,
                       int box_heads = 1) {
    return encode_token_map(encode, T::kHeadDim, base, bs, ts, hs, varlen, tokens, heads, batches, rows, map,
                            box_heads);
  };
  const route::RouteParams& p = a.route;
  int kv_rows = T::kPairMulticast ? T::kBlockN / 2 : T::kRouteN;
  if (p.proxy_mode != 0 &&
      !(one(a.k_summary, a.summary_batch_stride, a.summary_block_stride, a.summary_head_stride, false,
            p.max_kv_blocks, p.heads_kv, p.batch, kv_rows, maps.k_summary) &&
        one(a.v_summary, a.v_summary_batch_stride, a.v_summary_block_stride, a.v_summary_head_stride, false,
            p.max_kv_blocks, p.heads_kv, p.batch, kv_rows, maps.v_summary)))
    return false;
  std::int64_t kv_batches = p.batch;
  if (p.paged) {
    kv_rows = 0;
    for (int r : {128, 64, 32, 16})
      if (!kv_rows && r <= (T::kPairMulticast ? T::kBlockN / 2 : T::kBlockN) && T::kBlockN % r == 0 &&
          a.page_size % r == 0 && p.tile_n % r == 0)
        kv_rows = r;
    if (!kv_rows || extents.kv_pages >= (std::int64_t(1) << 31)) return false;
    kv_batches = extents.kv_pages;
    maps.page_box_rows = kv_rows;
    maps.kv_pages = static_cast<int>(extents.kv_pages);
  }
  // Q and O boxes: 64 rows of one head, or a decode tile's T tokens of P heads.
  const int q_heads = maps.decode.packed_heads, q_rows = 64 / q_heads;
  maps.tma_out = a.out_type != ElementType::f32 && one(a.out, a.out_batch_stride, a.out_token_stride,
                                                       a.out_head_stride, p.varlen_q, extents.q, p.heads_q, p.batch,
                                                       q_rows, maps.o, q_heads);
  return one(a.q, a.q_batch_stride, a.q_token_stride, a.q_head_stride, p.varlen_q, extents.q, p.heads_q, p.batch,
             q_rows, maps.q, q_heads) &&
         one(a.k, a.k_batch_stride, a.k_token_stride, a.k_head_stride, p.varlen_kv, extents.kv, p.heads_kv,
             kv_batches, kv_rows, maps.k) &&
         one(a.v, a.v_batch_stride, a.v_token_stride, a.v_head_stride, p.varlen_kv, extents.kv, p.heads_kv,
             kv_batches, kv_rows, maps.v);
}

}  // namespace bsattn::gpu::fwd
