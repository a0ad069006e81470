// The persistent warp-specialised SM90 forward kernel. One CTA per multiprocessor walks work
// tiles (route row, query head) longest row first. The producer warpgroup has two roles
// (producer_roles.cuh): the tile warp decodes the next tile and loads its Q rows (one buffer per
// consumer warpgroup, refilled as soon as the warpgroup's last S GEMM of the current tile has read
// it), and the loader streams the K and V tiles of the routes into shared memory (TMA or cp.async
// completing on mbarriers, K one route ahead of V; the pipeline runs on from tile to tile). The
// consumer warpgroups (consumer.cuh) run the GEMMs, the softmax and the epilogue. Registers move
// to the consumers (setmaxnreg; kernel_config.cuh). This file sets up the barriers and hands each
// warp its role.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bsattn/attention_params.hpp"
#include "gpu/fwd/consumer.cuh"
#include "gpu/fwd/kernel_config.cuh"
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/producer_roles.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/timeline.cuh"

namespace bsattn::gpu::fwd {

// kTokenTensors: the mask policy (RouteMask::apply); the launch picks the kernel by problem.
// kProxy: proxy compensation (proxy.cuh), only in the kernels of problems with proxy routes.
// kFromLengths: the kernel can make its routes from the sequence lengths (a runtime choice,
// AttentionParams::routes_from_lengths): compiled into the decode kernel, and a prefill instance of
// its own, since the path cost the common prefill kernel 3-5 % (bench/RESULTS.md, 2026-12-03).
template <class T, bool kTokenTensors, bool kProxy = false, bool kFromLengths = false>
__global__ void __launch_bounds__(WsConfig<T>::kThreads, T::kCtasPerSm)
    forward_kernel_ws(const __grid_constant__ AttentionParams a, const int* __restrict__ overflow,
                      const __grid_constant__ LaunchDescriptors desc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = WsConfig<T>;
  using Barrier = cutlass::arch::ClusterBarrier;
  static_assert(T::kWarpgroups <= 2 && T::kBlockN >= 64, "O of a warpgroup is staged in a K or V stage");
  constexpr int kStages = T::kStages;
  extern __shared__ char smem_raw[];
  // Aligned by pointer arithmetic on the shared array (not through an integer), so the compiler
  // keeps the shared address space: LDS/STS for the tile slots and the epilogue, not generic
  // loads and stores.
  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  auto& sm = *reinterpret_cast<typename C::Smem*>(smem_raw + ((1024u - smem_base % 1024u) % 1024u));
  auto& st = sm.tiles;
  auto& bars = sm.bars;
  constexpr bool kPair = T::kPairMulticast;
  // Pair multicast: both CTAs of the cluster walk the same items (scheduler.cuh); the threads
  // still running at the end pass a cluster barrier before they leave (it waits for non-exited
  // threads only), as the peer may still write into this CTA's shared memory and barriers.
  const int pair_rank = kPair ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  const auto leave = [&]() {
    if constexpr (kPair) cluster_sync_threads();
  };
  const bool tma = desc.tma;  // Q, K and V by TMA (else cp.async: BSATTN_GPU_NO_TMA)
  const int tid = threadIdx.x;
  const int role = __shfl_sync(0xffffffffu, tid / 128, 0);  // 0: producer; 1..: consumer warpgroups
  if (tid == 0) {
    timeline_mark(desc.timeline, kAtEntry);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&bars.full_k[s], tma ? 1 : kLoaderThreads);
      Barrier::init(&bars.full_v[s], tma ? 1 : kLoaderThreads);
      Barrier::init(&bars.empty_k[s], C::kConsumerWarps * (kPair ? 2 : 1));  // both CTAs' consumers
      Barrier::init(&bars.empty_v[s], C::kConsumerWarps * (kPair ? 2 : 1));
    }
    CUTE_UNROLL
    for (int wg = 0; wg < T::kWarpgroups; ++wg) {
      Barrier::init(&bars.full_q[wg], tma ? 1 : 32);  // the tile warp's lane 0 or lanes
      Barrier::init(&bars.empty_q[wg], 4);  // the warpgroup's warps
    }
    if constexpr (T::kDecode) Barrier::init(&sm.inbox.full, 1);  // its owner's expect_tx (push_partial)
    cutlass::arch::fence_barrier_init();
    sm.tile[0].written = sm.tile[1].written = 0;
    sm.split_merge.pending = 0;
  }
  if constexpr (kPair) cluster_sync_threads();  // the peer's barriers are initialised before any use
  else __syncthreads();
  // A split merge in a cluster: the barrier whose wait precedes the first push (split_merge.cuh).
  if (T::kDecode && desc.decode.cluster_merge) cluster_arrive();
  if (tid == 0) timeline_mark(desc.timeline, kBarriersReady);
  // A decode launch may start before route preparation has finished (programmatic dependent
  // launch, launch.cuh): nothing the preparation writes is read before this wait (elsewhere a
  // no-op), so the CTAs' placement and barrier setup overlap it. With rows in index order (no
  // sort) the tile warp places its first tile and loads its Q first, and waits then (hand_out).
  // Routes made from the sequence lengths (AttentionParams::routes_from_lengths; a decode step or
  // a prefill whose work items all fit at once): only with the positional mask, so never in the
  // kernels that read token tensors nor in the proxy kernels. No route preparation ran, so nothing
  // can overflow and the flag is not read (a dependent load less before the first tile), and
  // nothing is waited for: the first tile's routes go to the loader before its Q is loaded.
  static_assert(!kFromLengths || (!kTokenTensors && !kProxy), "routes from the lengths: positional mask, exact routes");
  const bool from_lengths = kFromLengths && a.routes_from_lengths;
  const bool may_overflow = !from_lengths;
  const bool q_before_routes = T::kDecode && a.row_order == nullptr && may_overflow;
  if (!(q_before_routes && role == 0 && tid / 32 == C::kTileWarp)) {
    if constexpr (T::kDecode) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (may_overflow && *overflow != 0) return;  // an overflowing run writes nothing (Plan::check reports it)
  }
  if (tid == 0) timeline_mark(desc.timeline, kDependencyMet);
  // Tile handoff (producer_roles.cuh): slot t % 2 holds this CTA's tile t, decoded one ahead by
  // the tile warp.
  const TileHandoff<T::kThreads> handoff{tma ? 32 : kLoaderThreads};

  if (role == 0) {
    // ---------------------------------------------------------------- producer warpgroup
    // Two roles with their own registers (producer_roles.cuh): the tile warp, and the K/V loader.
    cutlass::arch::warpgroup_reg_dealloc<C::template Registers<kProxy>::kProducer>();
    const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
    if (warp == C::kTileWarp) {
      run_tile_warp<T, kProxy>(handoff, sm.tile, a, desc, st, bars, overflow, tma, q_before_routes, may_overflow,
                               from_lengths, pair_rank, tid % 32);
      leave();
      return;
    }
    // With TMA one thread issues the bulk tensor copies (a paged cache: one warp, a box per lane);
    // the others exit rather than wait in leave() (a live lane that skips the tile-handoff
    // bar.arrive would stall it).
    const int issuers = !tma ? kLoaderThreads : a.route.paged ? 32 : 1;
    if (tid >= issuers) return;
    run_loader<T, kProxy>(handoff, sm.tile, a, desc, st, bars, tma, tid);
    leave();
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups (consumer.cuh)
  cutlass::arch::warpgroup_reg_alloc<C::template Registers<kProxy>::kConsumer>();
  run_consumers<T, kTokenTensors, kProxy, kFromLengths>(sm, a, desc, handoff, tma, role - 1, tid, pair_rank);
  leave();
#endif
}

}  // namespace bsattn::gpu::fwd
