// The producer warpgroup's two roles, and the tile handoff that connects them to the consumers.
// The tile warp claims and decodes the CTA's next work tile into a shared slot and loads its Q as
// soon as the consumers' last S GEMM of the current tile freed the Q buffers; the K/V loader
// (thread 0 with TMA, a warp for a paged cache, warps 0-2 with cp.async) streams the tile's
// routes into the stages. Each role has its own code and registers: done by one thread, decode,
// Q and the route stream made the 40-register producer spill inside its route loop.
#pragma once
#include "bsattn/attention_params.hpp"
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/proxy.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/timeline.cuh"

namespace bsattn::gpu::fwd {

// Slot t % 2 of shared memory holds the CTA's tile t. The tile warp (lane 0 claims and decodes)
// writes the slot and arrives on two barriers of the slot: kFull + slot, which the consumers sync
// on, and kLoaderFull + slot, which the K/V loader syncs on; both read the slot in place while
// they work on the tile. The loader arrives on kEmpty + slot when it has issued the tile's loads,
// the consumers when they start tile t + 1; the tile warp syncs on it before writing tile t + 2
// there. So tiles are decoded one ahead, and the loader moves on to tile t + 1 as soon as it has
// issued tile t's last loads: with one full barrier for both it waited for the consumers to take
// tile t + 1 after their last PV of tile t, so the next tile's first K load was issued, and
// waited for, at the boundary (bench/RESULTS.md, 2026-12-06). Named barriers (not mbarriers):
// compute-sanitizer's racecheck sees the ordering. Each consumer warpgroup takes the tile from a
// full barrier of its own (with the tile warp), so that neither waits for the other at the
// boundary: with O staged in buffers of their own (WsConfig::kOutputBuffer) the ping-pong order of
// their GEMMs runs on across tiles, and one warpgroup's epilogue runs under the other's GEMMs.
// Named barrier ids: 0 __syncthreads; 1, 2 the consumer warpgroups; 3, 4 ping-pong; 5, 6, 12, 13
// (consumers) and 7, 8, 10, 11 (empty, loader) the handoff; 9 the epilogue (consumer.cuh). The
// slots are named at each use rather than held here: a pointer held across the consumers' loop
// took a register there (the decode kernel's consumers spilled).
template <int kConsumerThreads>
struct TileHandoff {
  static constexpr int kFull = 5, kEmpty = 7, kLoaderFull = 10, kFullSecond = 12;
  static constexpr int kTileWarp = 32;
  static constexpr int kWarpgroups = kConsumerThreads / 128;
  int loader_threads;  // the K/V loader's warps, as a barrier counts them (a TMA issuer's warp: 32)

  __device__ __forceinline__ int everyone() const { return kConsumerThreads + kTileWarp + loader_threads; }
  __device__ __forceinline__ static int full(int wg, int s) { return (wg == 0 ? kFull : kFullSecond) + s; }
  // Tile warp: slot s is written.
  __device__ __forceinline__ void publish(int s) const {
    CUTE_UNROLL
    for (int wg = 0; wg < kWarpgroups; ++wg) barrier_arrive(full(wg, s), 128 + kTileWarp);
    barrier_arrive(kLoaderFull + s, kTileWarp + loader_threads);
  }
  // Consumer warpgroup wg's side of tile t: null when there is no more work (then nothing is released).
  __device__ __forceinline__ const Tile* take(const Tile (&slots)[2], int t, int wg) const {
    barrier_sync(full(wg, t & 1), 128 + kTileWarp);
    const Tile* tile = &slots[t & 1];
    return tile->row < 0 ? nullptr : tile;
  }
  // Loader's side of the tile in slot s.
  __device__ __forceinline__ void take_for_loader(int s) const {
    barrier_sync(kLoaderFull + s, kTileWarp + loader_threads);
  }
  // Consumers (tile t) and loader (its slot, t & 1): done with the slot.
  __device__ __forceinline__ void release(int t) const { barrier_arrive(kEmpty + (t & 1), everyone()); }
  __device__ __forceinline__ void wait_empty(int s) const { barrier_sync(kEmpty + s, everyone()); }
};

// The tile warp (`lane`: its lane). Tile t goes into slot t % 2. The loop walks the two slots in
// turn with the slot a compile-time constant, so no tile counter is held (the 40-register
// producer spilled one): the slots' `written` flags tell the first two tiles, and the previous
// tile's slot gives the next item and pipeline position. `q_early`: the first tile's Q is loaded
// before the wait for route preparation (a decode kernel with rows in index order), whatever
// its route count; if that preparation overflowed, the warp leaves once Q has landed.
template <class T, bool kProxy>
__device__ __forceinline__ void run_tile_warp(const TileHandoff<T::kThreads>& handoff, Tile (&slots)[2],
                                              const AttentionParams& a, const LaunchDescriptors& desc,
                                              typename T::SharedStorage& st,
                                              PipelineBarriers<T::kStages, T::kWarpgroups>& bars, const int* overflow,
                                              bool tma, bool q_early, bool may_overflow, bool from_lengths,
                                              int pair_rank, int lane) {
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr bool kPair = T::kPairMulticast;
  // Route counts a window's numbering may read (place_tile): the same answer for every item of the
  // launch, the first tile's included.
  const bool counts_ready = !q_early && !from_lengths;
  // Returns false once it wrote the end of work.
  const auto hand_out = [&](auto slot_index) -> bool {
    constexpr int s = decltype(slot_index)::value;
    Tile& slot = slots[s];
    const Tile& prev = slots[1 - s];
    const int item_heads = T::kDecode ? desc.decode.packed_heads : T::kItemHeads;
    const int splits = T::kDecode ? desc.decode.kv_splits : 1;
    // Lane 0 alone reads the flag it writes below.
    if (__shfl_sync(0xffffffffu, lane == 0 ? slot.written : 0, 0))
      handoff.wait_empty(s);
    if (lane == 0) {
      const int items = live_work_items(a, item_heads, splits);
      const int item = !prev.written ? first_item<kPair>() : next_item<kPair>(a, prev.item, items);
      const int concurrent = static_cast<int>(gridDim.x) / (kPair ? 2 : 1);  // CTAs, or pairs, in flight
      if (item < items) place_tile<kPair>(a, item, items, item_heads, concurrent, counts_ready, slot, splits);
      else slot.row = -1;  // no more work
    }
    __syncwarp();
    const bool has_tile = slot.row >= 0;
    if (q_early) {
      if (has_tile) load_q<T>(slot, s, tma, a, desc, st, bars, pair_rank, true);
      if (lane == 0) timeline_mark(desc.timeline, kQIssued);
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      if (may_overflow && *overflow != 0) {  // the other threads have left; Q must land before this warp does
        if (has_tile && tma && lane == 0) Barrier::wait(&bars.full_q[0], 0);
        return false;
      }
    }
    if (lane == 0) {
      if (has_tile)
        tile_routes(a, !prev.written ? 0 : prev.first + prev.count, slot, kProxy ? T::kBlockN : 0, splits,
                    from_lengths, T::kRoutesPerStep);
      slot.written = 1;
      if (!prev.written) timeline_mark(desc.timeline, kTileDecoded);
    }
    __syncwarp();
    handoff.publish(s);
    if (!has_tile) return false;
    if (!q_early) load_q<T>(slot, s, tma, a, desc, st, bars, pair_rank, slot.count > 0);
    if (s == 0 && lane == 0 && !q_early && !prev.written) timeline_mark(desc.timeline, kQIssued);
    q_early = false;
    return true;
  };
  while (hand_out(Int<0>{}) && hand_out(Int<1>{})) {
  }
  cp_async_wait<0>();
}

// The K/V loader (`tid`: its thread, below the issuer count). A proxy kernel's windows follow a
// tile's exact routes from the same threads.
template <class T, bool kProxy>
__device__ __forceinline__ void run_loader(const TileHandoff<T::kThreads>& handoff, const Tile (&slots)[2],
                                           const AttentionParams& a, const LaunchDescriptors& desc,
                                           typename T::SharedStorage& st,
                                           PipelineBarriers<T::kStages, T::kWarpgroups>& bars, bool tma, int tid) {
  bool first_tile = true;  // for the timeline marks only
  const auto stream = [&](auto slot_index) -> bool {
    constexpr int s = decltype(slot_index)::value;
    handoff.take_for_loader(s);
    const Tile& slot = slots[s];
    if (slot.row < 0) return false;
    if (tid == 0 && first_tile) timeline_mark(desc.timeline, kLoaderHasTile);
    load_tile_routes<T, kProxy>(slot, tma, a, desc, st, bars, tid);
    if constexpr (kProxy) load_proxy_windows<T>(slot, tma, a, desc, st, bars, tid);
    if (tid == 0 && first_tile) timeline_mark(desc.timeline, kLoaderIssued);
    first_tile = false;
    handoff.release(s);
    return true;
  };
  while (stream(Int<0>{}) && stream(Int<1>{})) {
  }
  if (!tma) cp_async_wait<0>();
}

}  // namespace bsattn::gpu::fwd
