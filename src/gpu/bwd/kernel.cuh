// The SM90 backward kernel. One CTA per (KV tile, KV head, batch): K and V stay in shared memory
// while the CTA walks, for every query head of the KV head's group, the Q tiles that attend this
// KV tile (the column stream, steps.cuh) in steps of T::kStepRows rows. Warp specialised:
//  * the producer warpgroup (loader.cuh) walks the steps and loads each step's Q, dO (TMA), LSE
//    and delta into a free stage, up to kStages steps ahead of the consumers;
//  * two consumer warpgroups compute, per step, the scores S and dP (traits.cuh: with 128-wide
//    tiles each consumer's own 64 KV rows, transposed; solo, each consumer every other step alone,
//    transposed; else each its half of the KV columns);
//    once S is complete the forward's route mask (mask.cuh) and P = exp2(S * scale * log2(e) -
//    LSE * log2(e)) while dP completes; with 128-wide tiles P^T, in registers, feeds dV at once;
//    then dS = P (dP - delta) to shared memory (and, transposed, dS^T from registers into dK); one
//    barrier of both consumers (solo: of the consumer); dQ = dS K (dq.cuh), whose adds into the
//    fp32 accumulator run under the dK / dV GEMM (solo: under the other consumer's GEMMs).
// dK and dV stay in registers over the whole walk (the group's query heads summed there, GQA) and
// are stored once (epilogue.cuh; solo consumers' partials summed first).
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bsattn/backward_params.hpp"
#include "gpu/backward.hpp"
#include "gpu/bwd/dq.cuh"
#include "gpu/bwd/epilogue.cuh"
#include "gpu/bwd/loader.cuh"
#include "gpu/bwd/steps.cuh"
#include "gpu/bwd/traits.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/softmax.cuh"
#include "gpu/fwd/timeline.cuh"

namespace bsattn::gpu::bwd {

// dV += P^T dO or dK += dS^T Q of 64 KV rows. `a`: P^T or dS^T, the register A operand
// (kTransposed), or the 64 x 64 block of P or dS in shared memory whose KV columns are the GEMM's rows;
// `staged`: dO or Q (all stages; the B operand is its transpose).
// The warpgroup's shared-memory operands are the same for each of its threads: their descriptors
// come from thread 0's slice, a constant, so ptxas keeps them in uniform registers.
template <class T, class A, class Acc>
__device__ __forceinline__ void issue_dkv_gemm(const A& a, const typename T::Element* staged, int stage, Acc& acc) {
  typename T::MmaDKV mma;
  auto thr = mma.get_thread_slice(0);
  Tensor bt = make_tensor(make_smem_ptr(staged), typename T::SmemLayoutQt{});
  // The stage is picked among the operand descriptors: a slice of the swizzled layout itself would
  // keep its offset inside the layout, where the descriptors do not see it.
  if constexpr (T::kTransposed) {
    wg_gemm<false, true>(mma, a, thr.partition_fragment_B(bt)(_, _, _, stage), acc);
  } else {
    Tensor sa = make_tensor(make_smem_ptr(a), typename T::SmemLayoutBlockT{});
    wg_gemm<false, false>(mma, thr.partition_fragment_A(sa), thr.partition_fragment_B(bt)(_, _, _, stage), acc);
  }
}

// P or dS from registers (`frag`, the MMA's accumulator layout) into a 128-byte-swizzled shared
// tile at 1 KB-aligned `smem` by stmatrix x4 (CopyOp: SM90_U16x8_STSM_T or SM90_U32x4_STSM_N),
// addressed in 32 bits. cute's copy swizzles each store's 64-bit generic address (~35
// instructions for the four stores of dS^T). The swizzle reads and writes only bits below its
// period (1 KB), so a store's constant offset from the thread's first element splits into a part
// below the period, swizzled with the thread's offset, and multiples of the period, added after
// it (the store's immediate): the four stores of dS^T share one swizzled address.
template <class CopyOp, class ThrCopy, class Frag, class Swizzle_, int kBits, class Layout_>
__device__ __forceinline__ void store_swizzled(const ThrCopy& thr, const Frag& frag,
                                               ComposedLayout<Swizzle_, smem_ptr_flag_bits<kBits>, Layout_> layout,
                                               const void* smem) {
  using Element = typename Frag::value_type;
  static_assert(kBits == 8 * sizeof(Element) && Swizzle_::num_shft > 0, "a byte swizzle of the fragment's elements");
  constexpr int kPeriod = 1 << (Swizzle_::num_base + Swizzle_::num_shft + Swizzle_::num_bits);
  constexpr int kBytes = sizeof(Element);
  // Element offsets (unswizzled) of the thread's values, the counting tensor's base the thread's
  // first; both as (a store's 8 values, the stores).
  Tensor offsets = thr.partition_D(make_tensor(counting_iterator<int>(0), layout.layout_b()));
  Tensor src = thr.retile_S(frag);
  const auto per_store = [](auto layout_) {
    auto flat = flatten(layout_);
    return group<1, decltype(rank(flat))::value>(flat);
  };
  const auto store_offsets = per_store(offsets.layout());
  Tensor values = make_tensor(src.data(), per_store(src.layout()));
  static_assert(size<0>(store_offsets) == 16 / kBytes && size<0>(values) == 16 / kBytes, "16 bytes per store");
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned first = kBytes * *offsets.data();
  CUTE_UNROLL
  for (int k = 0; k < size<1>(values); ++k) {
    const unsigned offset = kBytes * store_offsets(0, k);  // a constant after unrolling
    const unsigned addr = base + Swizzle_::apply(first + offset % kPeriod) + offset / kPeriod * kPeriod;
    Tensor r = recast<std::uint32_t>(values(_, k));
    if constexpr (std::is_same_v<CopyOp, SM90_U16x8_STSM_T>)
      asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                   "r"(r(0)), "r"(r(1)), "r"(r(2)), "r"(r(3)));
    else
      asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r(0)),
                   "r"(r(1)), "r"(r(2)), "r"(r(3)));
  }
}

// A score tile's (row, column) view as (query row, KV column): kTransposed scores are.
template <class Tensor_>
__device__ __forceinline__ auto query_major_of(Tensor_&& t, std::true_type) {
  return make_tensor(t.data(), make_layout(layout<1>(t), layout<0>(t)));
}
template <class Tensor_>
__device__ __forceinline__ auto query_major_of(Tensor_&& t, std::false_type) {
  return t;
}

// Coordinates (query row, KV column) of the score tile's elements, in the tile's own orientation.
template <class T>
__device__ __forceinline__ auto score_coordinates() {
  if constexpr (T::kTransposed)
    return make_coord_tensor(make_layout(Shape<Int<T::kBlockN>, Int<T::kStepRows>>{}, make_stride(E<1>{}, E<0>{})));
  else
    return make_identity_tensor(Shape<_64, Int<T::kBlockN>>{});
}

// kTokenTensors: the forward's mask policy (RouteMask::apply), picked by problem at launch.
template <class T, bool kTokenTensors>
__global__ void __launch_bounds__(T::kThreads, 1)
    backward_kernel(const __grid_constant__ BackwardParams g, const __grid_constant__ BackwardWorkspace ws,
                    const __grid_constant__ StepMaps maps, const int* __restrict__ overflow, int deterministic,
                    int max_kv_tiles, std::uint64_t* timeline) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kStages = T::kStages, kStepRows = T::kStepRows;
  extern __shared__ char smem_raw[];
  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  auto& st = *reinterpret_cast<typename T::SharedStorage*>(smem_raw + ((1024u - smem_base % 1024u) % 1024u));
  if (*overflow != 0) return;  // an overflowing run writes nothing (Plan::check reports it)

  const AttentionParams& a = g.fwd;
  const route::RouteParams& p = a.route;
  const int item = deterministic ? static_cast<int>(blockIdx.x) : ws.cta_order[blockIdx.x];
  const CtaExtent cta = CtaExtent::of(p, item, max_kv_tiles);
  const int kv_tile = cta.kv_tile, hkv = cta.hkv, b = cta.b, k0 = cta.k0, n_valid = cta.n_valid;
  const route::SeqInfo& si = cta.si;
  // A tile with routes is walked even past the owned rows (unvalidated lengths): the
  // deterministic dQ order waits for every route of a row.
  if (k0 >= cta.owned && n_valid == 0) return;
  const int tid = threadIdx.x;
  if (tid == 0) {
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&st.full[s], T::kProducerThreads + 1);  // every producer thread's copies, the step record
      Barrier::init(&st.empty[s], T::kStageReaderWarps);  // the consumer warps that read it
      Barrier::init(&st.record[s], 1);  // the step record, for the producer's warps that do not walk
    }
    Barrier::init(&st.kv_full, T::kProducerThreads);
    st.dkv_target = {g.kv_like_offset(g.dk_strides, b, si, k0, hkv), g.kv_like_offset(g.dv_strides, b, si, k0, hkv),
                     max(0, min(p.tile_n, cta.owned - k0))};
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const StepWalk walk =
      StepWalk::for_cta(p, ws.columns, ws.column_counts, max_kv_tiles, b, hkv, kv_tile, si.seqlen_q, T::kStepRows);
  if (__shfl_sync(0xffffffffu, tid / 128, 0) == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    produce_steps<T>(st, g, maps, ws, walk, b, si, k0, n_valid, hkv, tid);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = tid - T::kProducerThreads, wg = ctid / 128;  // consumer thread, consumer warpgroup
  // The shared-memory operands' descriptors depend on the warpgroup alone: from a warp-uniform
  // index ptxas builds them in uniform registers (an add per k step, no moves from the vector
  // registers before each wgmma), and keeps the index there across the step loop.
  const int warpgroup = __shfl_sync(0xffffffffu, wg, 0);
  const std::int64_t packed_base = p.varlen_q ? si.q_base : static_cast<std::int64_t>(b) * p.max_seqlen_q;

  typename T::MmaSdP mma_sdp;
  typename T::MmaDKV mma_dkv;
  // kTransposed: dV and dK of the consumer's 64 KV rows (solo: partials over its steps); else dV
  // (consumer 0) or dK (consumer 1).
  Tensor acc_dkv = partition_fragment_C(mma_dkv, Shape<_64, Int<kHeadDim>>{});
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<_64, Int<kHeadDim>>{});
  clear(acc_dkv);
  if constexpr (T::kTransposed) clear(acc_dk);
  const float scale_log2 = a.scale * float(M_LOG2E);
  using ScoreShape = std::conditional_t<T::kTransposed, Shape<Int<kBlockN>, Int<kStepRows>>, Shape<_64, Int<kBlockN>>>;
  const auto query_major = [](auto&& t) { return query_major_of(t, std::bool_constant<T::kTransposed>{}); };
  Barrier::wait(&st.kv_full, 0);
  float* staged_dq = nullptr;  // the previous step's staged dQ block, to be bulk-added (add_dq)
  // A consumer warp releases a stage: its reads are done (and, solo, its bulk reductions' reads).
  // `thread`: the consumer thread's index, the step's opaque one (ctid would stay live across the
  // step loop).
  const auto release = [&](int stage_done, int thread) {
    if constexpr (T::kSolo)
      if (dq_bulk_leader(thread)) fwd::bulk_store_wait<true>();
    __syncwarp();  // the warp's reads of the stage before its leader releases it
    if (thread % 32 == 0) Barrier::arrive(&st.empty[stage_done]);
  };

  for (int k = 0;; ++k) {
    // Solo: consumer w takes the walk's steps w, w + 2, ... (stages w and w + 2 of four).
    const int i = T::kSolo ? 2 * k + warpgroup : k;
    const int stage = i % kStages;
    Barrier::wait(&st.full[stage], (i / kStages) & 1);
    const Step step = st.step[stage];
    if (step.head < 0) break;
    const auto mark = [&](int event) { fwd::timeline_step(timeline, i, warpgroup, event); };
    mark(fwd::kBwdStageFull);
    const unsigned units = step.units;
    const int buffer = i % 2;  // P's and dS's double buffers

    // Thread-dependent operand views are derived per step from an opaque thread index: hoisted
    // out of the step loop, their descriptors and addresses would stay live across it and spill.
    // Its range is stated: the views' divisions and remainders by powers of two of a possibly
    // negative index cost sign fix-ups (LEA.HI / SHF.R.S32) every step.
    const int ltid = fwd::opaque_thread_index() - T::kProducerThreads;
    __builtin_assume(ltid >= 0 && ltid < T::kConsumerThreads);
    const int mtid = T::kSolo ? ltid % 128 : ltid;  // the thread's index in the score MMA
    const int dq_tid = T::kSolo ? mtid : ltid - 128 * T::kDqWarpgroup0;
    auto thr_sdp = mma_sdp.get_thread_slice(mtid);
    auto ops_sdp = mma_sdp.get_thread_slice(T::kSolo ? 0 : warpgroup * 128);  // the operands' slice: descriptors
    Tensor sQ = make_tensor(make_smem_ptr(st.q), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.dout), typename T::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutK{});

    // S and dP (kTransposed: S^T = K Q^T and dP^T = V dO^T).
    Tensor tSrS = partition_fragment_C(mma_sdp, ScoreShape{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, ScoreShape{});
    mark(fwd::kBwdSetupDone);
    if constexpr (T::kTransposed) {
      wg_gemm<true, false>(mma_sdp, ops_sdp.partition_fragment_A(sK),
                           ops_sdp.partition_fragment_B(sQ)(_, _, _, stage), tSrS);
      mark(fwd::kBwdSIssued);
      wg_gemm<true, false>(mma_sdp, ops_sdp.partition_fragment_A(sV),
                           ops_sdp.partition_fragment_B(sdO)(_, _, _, stage), tdPrdP);
    } else {
      wg_gemm<true, false>(mma_sdp, ops_sdp.partition_fragment_A(sQ)(_, _, _, stage),
                           ops_sdp.partition_fragment_B(sK), tSrS);
      mark(fwd::kBwdSIssued);
      wg_gemm<true, false>(mma_sdp, ops_sdp.partition_fragment_A(sdO)(_, _, _, stage),
                           ops_sdp.partition_fragment_B(sV), tdPrdP);
    }
    mark(fwd::kBwdDpIssued);
    if constexpr (T::kSolo) {
      // The consumer's previous step (two steps back in the walk, two stages back) holds its staged
      // dQ until the bulk reductions have read it, here, under this step's S and dP GEMMs.
      if (k > 0) release((stage + 2) % kStages, ltid);
    } else if constexpr (T::kDqBulk) {
      if (staged_dq) issue_staged_dq<T>(st, staged_dq, 0, dq_tid);  // under the S and dP GEMMs
    }
    // S is complete (dP may still run): the route mask exactly as in the forward, P, and P out
    // (registers or shared memory) under the dP GEMM. The views below are (query row, KV column)
    // in either orientation.
    warpgroup_wait<1>();
    mark(fwd::kBwdScoresDone);
    warpgroup_fence_operand(tSrS);
    Tensor s_rc = query_major(make_tensor(tSrS.data(), fwd::acc_rowcol(tSrS.layout())));
    Tensor dp_rc = query_major(make_tensor(tdPrdP.data(), fwd::acc_rowcol(tdPrdP.layout())));
    Tensor cS = thr_sdp.partition_C(score_coordinates<T>());
    Tensor c_rc = query_major(make_tensor(cS.data(), fwd::acc_rowcol(cS.layout())));
    const ColumnRoute& route = step.route;
    if ((route.masked & units) != 0 || (route.rows & units) != units || step.q0 + kStepRows > si.seqlen_q ||
        n_valid < kBlockN) {
      fwd::RouteMask m;
      m.q_begin = step.q0;
      m.tile_row0 = step.sub * kStepRows;
      m.token_mask = kStepRows - 1;
      m.k0 = k0;
      m.n_valid = n_valid;
      m.rows = route.rows;
      m.masked = route.masked;
      m.unit_m = p.unit_m;
      m.template apply<kTokenTensors>(s_rc, c_rc, a, si, b);
    }
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s_rc); ++r) {
      const float lse = st.lse_log2[stage][get<0>(c_rc(r, 0))];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) s_rc(r, c) = fwd::exp2_ftz(s_rc(r, c) * scale_log2 - lse);
    }
    // P and dS in the input dtype: kTransposed, as the register A operand of dV / dK (dS also to
    // shared memory, transposed, for dQ); else to shared memory. stmatrix: 8 x 8 matrices, 16
    // bytes per thread and instruction.
    Tensor rP = make_tensor<Element>(fwd::acc_as_a_operand(tSrS.layout()));
    Tensor rdS = make_tensor<Element>(fwd::acc_as_a_operand(tdPrdP.layout()));
    const auto to_element = [](auto& dst, const auto& acc) {
      Tensor src = make_tensor(acc.data(), fwd::acc_as_a_operand(acc.layout()));
      CUTE_UNROLL
      for (int e = 0; e < size(dst); ++e) dst(e) = static_cast<Element>(src(e));
    };
    using StoreAtom = std::conditional_t<T::kTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
    auto copy_pds = make_tiled_copy_C(Copy_Atom<StoreAtom, Element>{}, mma_sdp);
    auto thr_copy = copy_pds.get_thread_slice(mtid);
    to_element(rP, tSrS);
    if constexpr (T::kTransposed) {
      // dV of the consumer's KV rows from its own P^T: issued now, under dS.
      issue_dkv_gemm<T>(rP, st.dout, stage, acc_dkv);
      mark(fwd::kBwdDvIssued);
      warpgroup_wait<1>();  // S and dP complete, dV in flight
    } else {
      store_swizzled<StoreAtom>(thr_copy, make_tensor(rP.data(), tSrS.layout()), typename T::SmemLayoutP{},
                                st.p.data + buffer * 64 * kBlockN);
      mark(fwd::kBwdDvIssued);
      warpgroup_wait<0>();
    }
    mark(fwd::kBwdDpDone);
    warpgroup_fence_operand(tdPrdP);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s_rc); ++r) {
      const float delta = st.delta[stage][get<0>(c_rc(r, 0))];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - delta);
    }
    to_element(rdS, tdPrdP);
    // Solo: the consumer's own dS buffer, free since its previous step's dQ GEMM completed.
    const int ds_buffer = T::kSolo ? warpgroup : buffer;
    {
      using DsLayout = std::conditional_t<T::kTransposed, typename T::SmemLayoutPt, typename T::SmemLayoutP>;
      store_swizzled<StoreAtom>(thr_copy, make_tensor(rdS.data(), tdPrdP.layout()), DsLayout{}, st.ds[ds_buffer]);
    }
    cutlass::arch::fence_view_async_shared();  // P and dS (generic-proxy stores) before the wgmma reads
    mark(fwd::kBwdDsStored);
    const bool dq_warpgroup = T::kDqWarpgroup0 == 0 || wg >= T::kDqWarpgroup0;  // no compare if both
    if constexpr (T::kSolo) {
      fwd::barrier_sync(kSoloDsBarrier + warpgroup, 128);
    } else {
      // The previous step's staged dQ has been read by its bulk reductions before anyone passes the
      // barrier and stores this step's (issued at this step's top, under its S and dP GEMMs).
      if constexpr (T::kDqBulk)
        if (dq_warpgroup && dq_bulk_leader(dq_tid)) fwd::bulk_store_wait<true>();
      fwd::barrier_sync(kStepBarrier, T::kConsumerThreads);
    }
    mark(fwd::kBwdStepBarrier);

    // dK (and, 64-wide tiles, dV) and dQ. dQ's GEMM goes first where both consumers compute it,
    // so its adds run under the dK / dV GEMM.
    const auto add_dq_after = [&](auto& acc_dq, int slice_tid) {
      warpgroup_fence_operand(acc_dq);
      mark(fwd::kBwdDqDone);
      staged_dq = add_dq<T>(acc_dq, st, step, stage, ws, packed_base, a, si, b, deterministic != 0,
                            deterministic != 0 && walk.last_of_record(step), slice_tid,
                            T::kSolo ? kSoloOrderBarrier + warpgroup : kDqOrderBarrier);
      mark(fwd::kBwdDqAdded);
    };
    const auto issue_dkv = [&]() {
      if constexpr (T::kTransposed) issue_dkv_gemm<T>(rdS, st.q, stage, acc_dk);
      else if (wg == 0) issue_dkv_gemm<T>(st.p.data + buffer * 64 * kBlockN, st.dout, stage, acc_dkv);
      else issue_dkv_gemm<T>(st.ds[buffer], st.q, stage, acc_dkv);
    };
    if constexpr (T::kDqFirst) {
      Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<Int<kStepRows>, Int<kHeadDim>>{});
      issue_dq_gemm<T>(st, buffer, acc_dq, (warpgroup - T::kDqWarpgroup0) * 128);
      issue_dkv();
      warpgroup_wait<1>();
      add_dq_after(acc_dq, dq_tid);
    } else if constexpr (T::kDqWarpgroups == 1 && !T::kSolo) {
      // D 64, 64-row steps: consumer 1 alone computes dQ; it issues dQ first and adds under its dK GEMM.
      if (dq_warpgroup) {
        Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<Int<kStepRows>, Int<kHeadDim>>{});
        issue_dq_gemm<T>(st, buffer, acc_dq, (warpgroup - T::kDqWarpgroup0) * 128);
        issue_dkv();
        warpgroup_wait<1>();
        add_dq_after(acc_dq, dq_tid);
      } else {
        issue_dkv();
      }
    } else if constexpr (T::kSolo) {
      // dK first, then dQ one region (kDqColumns) at a time, each staged in the stage whose Q and
      // dO the dK and dV GEMMs read, after they completed; the last region's add adds all.
      issue_dkv();
      Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<Int<kStepRows>, Int<kHeadDim>>{});
      CUTE_UNROLL
      for (int r = 0; r < T::kDqSlices; ++r) {
        if (r > 0) warpgroup_fence_operand(acc_dq);
        issue_dq_gemm<T>(st, ds_buffer, acc_dq, r * 128);
        warpgroup_wait<0>();
        if (r + 1 < T::kDqSlices) {
          warpgroup_fence_operand(acc_dq);
          stage_dq<T>(acc_dq, st, stage, r * 128 + dq_tid);
        } else {
          add_dq_after(acc_dq, r * 128 + dq_tid);
        }
      }
    } else {
      // D 256: dK / dV first (registers: dQ's 64 accumulators beside dK / dV's 128).
      issue_dkv();
      Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<Int<kStepRows>, Int<kHeadDim>>{});
      issue_dq_gemm<T>(st, buffer, acc_dq, (warpgroup - T::kDqWarpgroup0) * 128);
      warpgroup_wait<0>();
      add_dq_after(acc_dq, dq_tid);
    }
    warpgroup_wait<0>();
    mark(fwd::kBwdStepDone);
    warpgroup_fence_operand(acc_dkv);
    if constexpr (T::kTransposed) warpgroup_fence_operand(acc_dk);
    if constexpr (T::kSolo) {
      if (staged_dq) issue_staged_dq<T>(st, staged_dq, stage, dq_tid);  // the stage's release waits for it
    } else {
      release(stage, ltid);  // the stage's last readers are done
    }
  }
  if constexpr (T::kDqBulk) {
    const int dq_tid = T::kSolo ? ctid % 128 : ctid - 128 * T::kDqWarpgroup0;
    if (!T::kSolo && staged_dq) issue_staged_dq<T>(st, staged_dq, 0, dq_tid);
    if (wg >= T::kDqWarpgroup0 && dq_bulk_leader(dq_tid)) fwd::bulk_store_wait<false>();
  }
  const volatile DkvTarget& target = st.dkv_target;
  const int n_owned = target.rows;
  if constexpr (T::kSolo) {
    // Consumer 0 stores dV, consumer 1 dK, each with the other's partial added.
    sum_solo_partials<T>(acc_dkv, acc_dk, reinterpret_cast<float*>(st.q), wg, ctid % 128);
    if (wg == 0) store_dkv<T>(acc_dkv, ctid, g, target.dv, n_owned, false);
    else store_dkv<T>(acc_dk, ctid, g, target.dk, n_owned, true);
  } else if constexpr (T::kOwnRows) {
    const int row0 = 64 * wg;
    store_dkv<T>(acc_dkv, ctid, g, target.dv + row0 * g.dv_strides.token, n_owned - row0, false);
    store_dkv<T>(acc_dk, ctid, g, target.dk + row0 * g.dk_strides.token, n_owned - row0, true);
  } else if (wg == 1) {
    store_dkv<T>(acc_dkv, ctid, g, target.dk, n_owned, true);
  } else {
    store_dkv<T>(acc_dkv, ctid, g, target.dv, n_owned, false);
  }
#endif
}

template <class T, bool kTokenTensors>
cudaError_t launch_kernel(const BackwardParams& g, const BackwardWorkspace& ws, const int* overflow,
                          bool deterministic, cudaStream_t stream) {
  const AttentionParams& a = g.fwd;
  const route::RouteParams& p = a.route;
  const int max_kv_tiles = route::ceil_div(p.max_seqlen_kv, p.tile_n);
  const dim3 grid(static_cast<unsigned>(ws.geometry.ctas));  // Cta::of(order[block])
  // Q and dO maps (memoised encodes: a training loop on the same tensors copies them).
  StepMaps maps{};
  const fwd::EncodeTiled encode = fwd::tensor_map_encoder();
  const std::int64_t tokens = p.varlen_q ? ws.geometry.q_rows : p.max_seqlen_q;
  maps.tma = encode &&
             fwd::encode_token_map(encode, T::kHeadDim, a.q, a.q_batch_stride, a.q_token_stride, a.q_head_stride,
                                   p.varlen_q, tokens, p.heads_q, p.batch, 64, maps.q) &&
             fwd::encode_token_map(encode, T::kHeadDim, g.dout, g.dout_strides.batch, g.dout_strides.token,
                                   g.dout_strides.head, p.varlen_q, tokens, p.heads_q, p.batch, 64, maps.dout);
  backward_kernel<T, kTokenTensors>
      <<<grid, T::kThreads, T::kSmemBytes, stream>>>(g, ws, maps, overflow, deterministic ? 1 : 0, max_kv_tiles,
                                                    fwd::timeline_backward_buffer());
  return cudaGetLastError();
}

// g == nullptr: only raises the kernels' shared-memory limit (plan time).
template <class T>
cudaError_t launch_backward(const BackwardParams* g, const BackwardWorkspace& ws, const int* overflow,
                            bool deterministic, cudaStream_t stream) {
  if (!g) {
    for (auto kernel : {backward_kernel<T, false>, backward_kernel<T, true>}) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
  if (g->fwd.route.doc_q || g->fwd.route.kv_valid)
    return launch_kernel<T, true>(*g, ws, overflow, deterministic, stream);
  return launch_kernel<T, false>(*g, ws, overflow, deterministic, stream);
}

}  // namespace bsattn::gpu::bwd
