// The consumer warpgroups of the persistent forward kernel (kernel_ws.cuh): kWarpgroups warpgroups
// of 64 query rows each (with GQA packing the same rows of one query head each) walk the CTA's work
// tiles as the tile warp hands them out (producer_roles.cuh) and run S = Q K^T and O += P V with
// wgmma on the K/V stages the loader fills, the route masks (mask.cuh), the online softmax
// (softmax.cuh), proxy windows (proxy.cuh) and the epilogue (epilogue.cuh, split_merge.cuh).
// Two consumer warpgroups take turns issuing their GEMM pair (ping-pong, two named barriers), so
// that one's softmax runs under the other's GEMMs; each waits on the stage barriers and releases
// the stages it read. Within a consumer, S(i+1) is issued before PV(i), and with two warpgroups
// the softmax of route i+1 is pinned (D > 64) ahead of the wait for PV(i), so it runs under both that GEMM
// and the other warpgroup's. The epilogue goes through shared memory (O's own buffer, else the
// last route's K/V stages) while the loader already streams the next tile and the next Q has landed.
#pragma once

#include <cutlass/arch/barrier.h>

#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/epilogue.cuh"
#include "gpu/fwd/kernel_config.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/producer_roles.cuh"
#include "gpu/fwd/proxy.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/softmax.cuh"
#include "gpu/fwd/split_merge.cuh"
#include "gpu/fwd/timeline.cuh"
#include "gpu/fwd/traits.cuh"

// Ping-pong scheduling of two consumer warpgroups (compile-time; 0 lets them drift, for
// measurement: ping-pong measured 0.5-1.4 % faster on 128 x 128 tiles and 4 % on 128 x 64 ones,
// bench/RESULTS.md 2026-12-03 06:25).
#ifndef BSATTN_FWD_PINGPONG
#define BSATTN_FWD_PINGPONG 1
#endif

namespace bsattn::gpu::fwd {

// Consumer warpgroup `wg` (thread `tid` of the CTA) until the tile handoff runs dry. The kernel's
// template flags as in forward_kernel_ws; `pair_rank`: the CTA's rank in a pair cluster (else 0).
template <class T, bool kTokenTensors, bool kProxy, bool kFromLengths>
__device__ __forceinline__ void run_consumers(typename WsConfig<T>::Smem& sm, const AttentionParams& a,
                                              const LaunchDescriptors& desc,
                                              const TileHandoff<T::kThreads>& handoff, bool tma, int wg, int tid,
                                              int pair_rank) {
  using C = WsConfig<T>;
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kStages = T::kStages;
  constexpr bool kPair = T::kPairMulticast;
  // O's staging (epilogue.cuh): a buffer of its own per warpgroup where shared memory has room
  // (WsConfig::kOutputBuffer), else the last route's K stage (warpgroup 0) or V stage (warpgroup
  // 1) after a barrier of the consumer warpgroups (named barrier 9).
  constexpr bool kOutputBuffer = C::kOutputBuffer;
  constexpr int kEpilogueSync = 9;
  auto& st = sm.tiles;
  auto& bars = sm.bars;
  const route::RouteParams& p = a.route;
  const bool warp_leader = (tid % 32) == 0;
  const int wg_tid = tid % 128;
  const int wg_barrier = 1 + wg;  // named barriers 1, 2 (0: __syncthreads; 3, 4: ping-pong)

  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(wg_tid);
  auto thr_pv = mma_pv.get_thread_slice(wg_tid);
  Tensor sQ = make_tensor(make_smem_ptr(st.q[wg]), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<_64, Int<kHeadDim>>{});
  Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor o_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor tOrP = make_tensor<Element>(acc_as_a_operand(tSrS.layout()));
  Tensor s_as_a = make_tensor(tSrS.data(), acc_as_a_operand(tSrS.layout()));
  constexpr int kRows = decltype(size<0>(s_rc))::value;
  constexpr bool kPingPong = T::kWarpgroups == 2 && BSATTN_FWD_PINGPONG;
  constexpr int kSchedBarrier0 = 3;

  auto convert_p = [&]() {
    CUTE_UNROLL
    for (int e = 0; e < size(tOrP); ++e) tOrP(e) = static_cast<Element>(s_as_a(e));
  };
  // Rows written by cp.async (the fallback loader, or a paged cache's sequence-end box) are
  // generic-proxy writes: the proxy fence orders them before the wgmma reads. Bulk tensor copies
  // land in the async proxy already, and the fence (a CTA-wide MEMBAR) would also wait for the
  // next route record's global load issued just before: none on the TMA path.
  const bool generic_stage_writes = !tma || p.paged;
  using Slot = PipelineSlot<kStages>;
  auto wait_full = [&](std::uint64_t* full, const Slot& slot) {
    Barrier::wait(&full[slot.stage], slot.phase);
    if (generic_stage_writes) cutlass::arch::fence_view_async_shared();
  };
  auto wait_q = [&](int t) {
    Barrier::wait(&bars.full_q[wg], t & 1);
    if (!tma) cutlass::arch::fence_view_async_shared();  // the Q rows (cp.async) before wgmma reads them
  };
  auto release = [&](std::uint64_t* empty, const Slot& slot) {
    const int stage = slot.stage;
    arrive_if(&empty[stage], warp_leader);
    if constexpr (kPair) {
      if (warp_leader) Barrier::arrive(&empty[stage], 1 - pair_rank, 1u);  // the peer loads into us too
    }
  };
  // After an S GEMM on `slot` that is not the tile's last (k) the K stage goes back to the loader.
  // The tile's last S GEMM keeps its K stage (until the last PV, or for the epilogue to stage O)
  // and returns the Q buffer to the tile warp instead, so the next tile's Q loads under the last
  // softmax, PV and the epilogue. One predicated arrival on a chosen barrier, no branch.
  auto release_k_or_q = [&](const Slot& slot, bool k) {
    arrive_if(k ? &bars.empty_k[slot.stage] : &bars.empty_q[wg], warp_leader);
    if constexpr (kPair) {
      if (k && warp_leader) Barrier::arrive(&bars.empty_k[slot.stage], 1 - pair_rank, 1u);
    }
  };
  auto release_q = [&]() { arrive_if(&bars.empty_q[wg], warp_leader); };

  // Tiles overlap at the boundary: the first S GEMM of tile t+1 is issued right after the last PV
  // of tile t and runs under tile t's epilogue (its Q has landed: the tile warp loaded it once the
  // last S GEMM of tile t freed the buffer). The waits are the same on every path (a branch
  // between wait_group<1> and <0> made ptxas serialise every wgmma: C7514).
  bool s_issued = false;  // S(first route) of `next` is in flight
  const Tile* next = handoff.take(sm.tile, 0, wg);
  const bool marker = tid == 128;  // timeline marks: consumer warpgroup 0's first thread
  if (marker) timeline_mark(desc.timeline, kConsumerHasTile);
  for (int t = 0; next; ++t) {
    const Tile& tile = *next;
    const int tile_item = tile.item;  // for the timeline only
    if (marker) timeline_tile(desc.timeline, t, false);
    wait_q(t);
    if (marker && t == 0) timeline_mark(desc.timeline, kConsumerHasQ);
    const int count = tile.count, base = tile.first;  // pipeline position of the first route
    if (count > 0 && !s_issued) {
      wait_full(bars.full_k, Slot(base));
      wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, Slot(base).stage), tSrS);
      if (marker && t == 0) timeline_mark(desc.timeline, kConsumerFirstS);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    // Thread-dependent addresses and coordinates are derived per tile from an opaque thread index:
    // hoisted out of the tile loop, they would stay live across the main loop and spill.
    const int ltid = opaque_thread_index() % 128;
    Tensor tScS = mma_qk.get_thread_slice(ltid).partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor tOcO = mma_pv.get_thread_slice(ltid).partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
    Tensor c_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    Tensor co_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    const route::SeqInfo& si = tile.si;
    // Read by every step: held in registers (the slot's fields are reloaded after each barrier
    // wait, whose asm clobbers memory).
    const route::Route* const routes = tile.routes;
    const int exact_routes = tile.exact;
    const int seqlen_kv = si.seqlen_kv;
    const int tile_row0 = warpgroup_row0<T>(wg);
    const int head = warpgroup_head<T>(tile, wg, pair_rank);
    const int q_begin = tile.q0 + tile_row0;
    const TileRows<T::kDecode> tile_rows{desc.decode.tokens_log2};
    unsigned present = 0;  // units of the tile that lie inside the sequence
    for (int u = 0; u * p.unit_m < (T::kDecode ? tile_rows.tokens() : T::kBlockM); ++u)
      if (tile.q0 + u * p.unit_m < si.seqlen_q) present |= 1u << u;

    OnlineSoftmax<kRows> softmax(a.scale);
    clear(tOrO);
    // Softmax of exact step `step` (its records rt): the routes' masks, where they cut, then the
    // plain step. Route pairs: columns [h kRouteN, (h + 1) kRouteN) are route h's.
    auto exact_softmax = [&](const StepRoutes<T::kRoutesPerStep>& rt, int step, float (&rescale)[kRows]) {
      RouteMask m[T::kRoutesPerStep];
      bool cut = false;
      CUTE_UNROLL
      for (int h = 0; h < T::kRoutesPerStep; ++h) {
        const int k0 = rt.route[h].index * p.tile_n;
        m[h].k0 = k0 - h * T::kRouteN;
        m[h].n_valid = h * T::kRouteN + min(p.tile_n, seqlen_kv - k0);
        m[h].rows = rt.route[h].rows;
        m[h].masked = rt.route[h].masked;
        cut |= rt.route[h].masked != 0 || (rt.route[h].rows & present) != present ||
               m[h].n_valid < (h + 1) * T::kRouteN;
      }
      if (cut) {
        CUTE_UNROLL
        for (int h = 0; h < T::kRoutesPerStep; ++h) {
          m[h].token_mask = tile_rows.tokens() - 1;
          m[h].q_begin = q_begin;
          m[h].tile_row0 = tile_row0;
          m[h].unit_m = p.unit_m;
        }
        constexpr int kSplit = decltype(size<1>(s_rc))::value / T::kRoutesPerStep;  // the left route's columns
        RouteMask::apply_split<kTokenTensors, true, kSplit>(m[0], m[T::kRoutesPerStep - 1], s_rc, c_rc, a, si, tile.b);
      }
      softmax.step(s_rc, rescale);
    };
    const auto exact_record = [&](int step) {
      return step_routes<T::kRoutesPerStep, kFromLengths>(a, tile, routes, exact_routes, step);
    };
    // Proxy kernels: the proxy steps' softmax from their candidate records (proxy.cuh).
    int proxy_cursor = tile.exact;  // the first proxy record not in an earlier window
    auto proxy_step_softmax = [&](const ProxyRecords<kBlockN>& records, int step, float (&rescale)[kRows]) {
      proxy_softmax<kBlockN, T::kRoutesPerStep>(s_rc, c_rc, tile, step, p.block_kv, tile_row0, p.unit_m, records,
                                                 proxy_cursor, softmax, rescale);
    };
    const auto proxy_records = [&](int) { return ProxyRecords<kBlockN>(tile, proxy_cursor); };

    // The last route's K and V stages stay held until the last PV is done, or, without O's own
    // buffer, through the epilogue, which stages O in them.
    const int last = base + count - 1;
    // What the epilogue needs of the slot, read before the next tile is taken: racecheck did not
    // follow the slot's release (TileHandoff::release) for reads between taking the next tile and it.
    route::SeqInfo out_si;
    int out_b = 0, out_unit = 0;
    OutputShift shift;  // a decode split writes its partial result
    const auto take_next = [&]() {
      out_si = si;
      out_b = tile.b;
      if constexpr (T::kDecode) {
        shift.out = tile.split * desc.decode.out_split_step;
        shift.lse = tile.split * desc.decode.lse_split_step;
        out_unit = tile.item / desc.decode.kv_splits;
      }
      return handoff.take(sm.tile, t + 1, wg);
    };
    if (count > 0) {
      release_k_or_q(Slot(base), count > 1);
      float rescale[kRows];  // of the last softmax: O takes it just before the next PV
      // Steps [0, exact_steps) are exact routes, the rest proxy windows (proxy kernels).
      const int exact_steps = kProxy ? exact_step_count<T::kRoutesPerStep>(tile) : count;
      if (!kProxy || exact_steps > 0) exact_softmax(exact_record(0), 0, rescale);
      else if constexpr (kProxy) proxy_step_softmax(proxy_records(0), 0, rescale);
      convert_p();
      // Steady state: S(i+1) and PV(i) in flight together; O takes the rescale of softmax i
      // while S(i+1) runs (PV(i-1) is complete), not between PV(i) completing and the next
      // GEMMs, where this warpgroup has nothing in flight.
      // Ping-pong (two consumer warpgroups): a warpgroup issues its two GEMMs only after the
      // other one issued its own, so one warpgroup's softmax runs under the other's GEMMs.
      if constexpr (kPingPong) {
        if (wg == 0) barrier_arrive(kSchedBarrier0, 256);
      }
      // Step i: `what(i + 1)` is read before the GEMMs are issued, so the load's latency hides
      // under them (a register carried one iteration ahead measured slower: bench/RESULTS.md),
      // and `step_softmax` takes it after S(i+1). Two loops, exact routes then proxy windows, so
      // that the exact steps run the exact kernels' loop. Forced inline: left to the compiler, the
      // lambda stayed a call in the decode and 64-row kernels, with a stack frame and spills.
      // `slot`: pipeline position base + i, carried from step to step.
      const auto steady_step = [&](int i, Slot& slot, const auto& what, auto& step_softmax)
                                   __attribute__((always_inline)) {
        const auto next_step = what(i + 1);
        const Slot now = slot, ahead = slot.next();
        wait_full(bars.full_k, ahead);
        if constexpr (kPingPong) barrier_sync(kSchedBarrier0 + wg, 256);
        wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, ahead.stage), tSrS);
        rescale_output(o_rc, rescale);
        wait_full(bars.full_v, now);
        wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, now.stage), tOrO);
        if constexpr (kPingPong) barrier_arrive(kSchedBarrier0 + (1 - wg), 256);
        warpgroup_wait<1>();  // S(i+1) done; PV(i) may still run
        warpgroup_fence_operand(tSrS);
        release_k_or_q(ahead, i + 2 < count);
        step_softmax(next_step, i + 1, rescale);
        // Two consumer warpgroups: a shared store of the new row sums, which ptxas does not move
        // past the wait, keeps the softmax ahead of it, under this warpgroup's own PV(i) (left to
        // itself ptxas put the wait at the start of the row max). 1-2 % on 128 x 128 tiles
        // (bench/RESULTS.md, 2026-12-03 07:05); one warpgroup has the other CTA's GEMMs instead.
        // A word per warp, stored by its lane 0 (predicated, in the same instruction stream), so
        // that no two threads write one word. Not at D 64, where PV(i) is short and ptxas's own
        // placement ran 1.7-1.9 % (per query head) and 3.3-3.5 % (shared pattern) faster
        // (bench/RESULTS.md, 2026-12-07 02:3x).
        if constexpr (T::kWarpgroups == 2 && kHeadDim > 64) {
          const int warp = tid / 32 - C::kProducerThreads / 32;  // consumer warp
          const unsigned pin = static_cast<unsigned>(__cvta_generic_to_shared(&sm.softmax_pin[warp]));
          asm volatile(
              "{\n .reg .pred p;\n setp.eq.u32 p, %2, 0;\n @p st.shared.f32 [%0], %1;\n}\n" ::"r"(pin),
              "f"(softmax.row_sum[0] + softmax.row_sum[kRows - 1]), "r"(tid % 32)
              : "memory");
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP);
        release(bars.empty_v, now);
        convert_p();
        slot = ahead;
      };
      Slot slot(base);
      CUTE_NO_UNROLL
      for (int i = 0; i < exact_steps - 1; ++i) steady_step(i, slot, exact_record, exact_softmax);
      if constexpr (kProxy) {
        CUTE_NO_UNROLL
        for (int i = max(exact_steps - 1, 0); i < count - 1; ++i)
          steady_step(i, slot, proxy_records, proxy_step_softmax);
      }
      // Balance the ping-pong barriers (the first arrive, or the other warpgroup's last one).
      if constexpr (kPingPong) {
        if (wg == 0) barrier_sync(kSchedBarrier0, 256);
      }
      // Last PV.
      rescale_output(o_rc, rescale);
      const Slot last_slot = slot;  // position last
      wait_full(bars.full_v, last_slot);
      wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, last_slot.stage), tOrO);
      // Then the next tile's first S GEMM, or, where there is none, a discarded S GEMM on this
      // tile's held stages (no other thread writes them now), so that the last PV is followed by
      // one GEMM on every path (an empty group is not counted by ptxas: it serialised every
      // wgmma). The next tile's Q can have landed only because this tile released its buffer.
      next = take_next();
      s_issued = next && next->count > 0;
      int stage = last_slot.stage;
      if (s_issued) {
        wait_q(t + 1);
        const Slot next_first(next->first);
        wait_full(bars.full_k, next_first);
        stage = next_first.stage;
      }
      wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
      warpgroup_wait<1>();  // the last PV is done
      // With a buffer of its own for O, the last stages go back to the loader now, so the next
      // tile's loads do not wait for the epilogue. (A discarded S GEMM may still read the K
      // stage: its result is never used.)
      if constexpr (kOutputBuffer) {
        release(bars.empty_k, last_slot);
        release(bars.empty_v, last_slot);
      }
    } else {
      next = take_next();
      s_issued = false;
    }
    warpgroup_fence_operand(tOrO);
    if (marker && t == 0) timeline_mark(desc.timeline, kConsumerLoopDone);

    if (q_begin - tile_row0 < out_si.seqlen_q) {  // else a tile past the sequence end: no rows
      float inv[kRows], lse[kRows];
      softmax.finish(inv, lse, a.scale);
      scale_rows(o_rc, inv);
      // O is staged in the warpgroup's buffer, or in the last route's K stage (warpgroup 0) or V
      // stage (warpgroup 1), each at least 64 x D, once every consumer warpgroup is done with
      // them; without a buffer, a tile without routes stages it in its own Q buffer.
      char* stage = reinterpret_cast<char*>(st.q[wg]);
      if constexpr (kOutputBuffer) {
        stage = reinterpret_cast<char*>(sm.out.o[wg]);
      } else if (count > 0) {
        barrier_sync(kEpilogueSync, T::kThreads);
        stage = reinterpret_cast<char*>(wg == 0 ? st.k + Slot(last).stage * kBlockN * kHeadDim
                                                : st.v + Slot(last).stage * kBlockN * kHeadDim);
      }
      bool pushed = false;  // a split's partial rows, to the CTAs that merge them (split_merge.cuh)
      if constexpr (T::kDecode) {
        if (desc.decode.cluster_merge) {
          push_partial(o_rc, co_rc, lse, sm.inbox, desc.decode, out_si, q_begin,
                       TileRows<true>{desc.decode.tokens_log2}, wg_tid);
          pushed = true;
        }
      }
      if (!pushed) {
        // Thread 0's coordinates: what the epilogue may fold at compile time (epilogue.cuh).
        Tensor tOcO0 = mma_pv.get_thread_slice(0).partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
        Tensor co_rc0 = make_tensor(tOcO0.data(), acc_rowcol(tOcO0.layout()));
        store_output<kHeadDim, kOutputBuffer>(o_rc, co_rc, co_rc0, lse, stage, a, desc.tma_out ? &desc.o : nullptr,
                                              out_si, out_b, head, q_begin, tile_rows, shift, ltid, wg_barrier);
      }
      if (marker && t == 0) timeline_mark(desc.timeline, kConsumerStored);
      if constexpr (T::kDecode) {
        if (ltid == 0 && desc.decode.kv_splits > 1)
          sm.split_merge = SplitMerge{1, 0, out_unit, out_b, head, q_begin, out_si};
      }
    }
    if (count > 0) {
      if constexpr (!kOutputBuffer) {
        cutlass::arch::fence_view_async_shared();  // the staging accesses before the next bulk copies
        __syncwarp();
        release(bars.empty_k, Slot(last));
        release(bars.empty_v, Slot(last));
      }
    } else {
      release_q();
    }
    handoff.release(t);  // done with the slot
    if (marker) timeline_tile(desc.timeline, t, true, tile_item, count);
  }
  warpgroup_wait<0>();  // a discarded S GEMM after the last tile
  if constexpr (T::kDecode) {
    const int tokens = TileRows<true>{desc.decode.tokens_log2}.tokens();
    if (desc.decode.cluster_merge)
      merge_cluster_splits(a, desc.decode, sm.split_merge, sm.inbox, tokens, opaque_thread_index() % 128, wg_barrier,
                           marker ? desc.timeline : nullptr);
    else if (desc.decode.kv_splits > 1)
      merge_splits<kHeadDim>(a, desc.decode, sm.split_merge, tokens, opaque_thread_index() % 128, wg_barrier,
                             marker ? desc.timeline : nullptr);
  }
  bulk_store_wait<false>();  // O's bulk stores have completed before the CTA exits
  if (marker) timeline_mark(desc.timeline, kConsumerExit);
}

}  // namespace bsattn::gpu::fwd
