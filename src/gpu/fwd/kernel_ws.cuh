// The warp-specialised SM90 forward kernel: one producer warpgroup streams the K and V tiles of
// the row's routes into shared memory (cp.async completing on mbarriers, two stages each, K one
// route ahead of V) while kWarpgroups consumer warpgroups (64 query rows each) run
// S = Q K^T and O += P V with wgmma. Registers move to the consumers (setmaxnreg). Consumers
// never wait for each other: each waits on the stage barriers and releases the stages it read,
// so the two warpgroups drift apart and their softmax phases interleave with the other's GEMMs.
// Within a consumer, S(i+1) is issued before PV(i), so the softmax of route i+1 overlaps PV(i).
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/epilogue.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/softmax.cuh"
#include "gpu/fwd/traits.cuh"

namespace bsattn::gpu::fwd {

// Stage barriers of the K and V pipelines.
template <int kStages>
struct PipelineBarriers {
  alignas(8) std::uint64_t full_k[kStages], empty_k[kStages], full_v[kStages], empty_v[kStages];
};

template <class T>
struct WsConfig {
  static constexpr int kProducerThreads = 128;
  static constexpr int kThreads = T::kThreads + kProducerThreads;
  static constexpr int kConsumerWarps = T::kThreads / 32;
  // Register split: 64K registers per SM, one CTA.
  static constexpr int kProducerRegs = T::kWarpgroups == 2 ? 40 : 56;
  static constexpr int kConsumerRegs = T::kWarpgroups == 2 ? 232 : 240;
  struct Smem {
    typename T::SharedStorage tiles;
    PipelineBarriers<T::kStages> bars;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;
};

// Producer side: 128 threads copy one K or V tile (16 bytes each per step), then each thread
// arrives on the stage's full barrier when its own copies have landed (count 128).
template <class T, bool kIsV>
__device__ __forceinline__ void produce_tile(typename T::SharedStorage& st, const typename T::Element* base,
                                             std::int64_t token_stride, int k0, int n_valid, int stage, int ptid) {
  constexpr int kChunks = T::kHeadDim / 8;
  constexpr int kRowsPerStep = 128 / kChunks;
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutVt{});
  const int d = (ptid % kChunks) * 8;
#pragma unroll 2
  for (int n0 = 0; n0 < T::kBlockN; n0 += kRowsPerStep) {
    const int n = n0 + ptid / kChunks;
    if (T::kBlockN % kRowsPerStep != 0 && n >= T::kBlockN) break;
    const bool valid = n < n_valid;
    const typename T::Element* src = valid ? base + static_cast<std::int64_t>(k0 + n) * token_stride + d : base;
    if constexpr (kIsV) cp_async_16(&sVt(d, n, stage), src, valid);
    else cp_async_16(&sK(n, d, stage), src, valid);
  }
}

__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(s) : "memory");
}

template <class T>
__global__ void __launch_bounds__(WsConfig<T>::kThreads, 1)
    forward_kernel_ws(const __grid_constant__ AttentionParams a, const int* __restrict__ overflow) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = WsConfig<T>;
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kStages = T::kStages;
  extern __shared__ char smem_raw[];
  auto& sm = *reinterpret_cast<typename C::Smem*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) &
                                                   ~std::uintptr_t(1023));
  auto& st = sm.tiles;
  auto& bars = sm.bars;
  if (*overflow != 0) return;  // an overflowing run writes nothing (Plan::check reports it)

  const route::RouteParams& p = a.route;
  const WorkItem w = work_item(a, blockIdx.x);
  const route::RowCoordinates rc = route::row_coordinates(p, w.row);
  const route::SeqInfo si = route::seq_info(p, rc.b);
  const int q0 = rc.q_tile * p.tile_m;
  if (q0 >= si.seqlen_q) return;
  const int b = rc.b, h = w.head, hkv = h / (p.heads_q / p.heads_kv);
  const route::Route* routes = a.routes + static_cast<std::int64_t>(w.row) * p.capacity;
  const int count = a.route_counts[w.row];

  const int tid = threadIdx.x;
  const int role = __shfl_sync(0xffffffffu, tid / 128, 0);  // 0: producer; 1..: consumer warpgroups
  if (tid == 0) {
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&bars.full_k[s], C::kProducerThreads);
      Barrier::init(&bars.full_v[s], C::kProducerThreads);
      Barrier::init(&bars.empty_k[s], C::kConsumerWarps);
      Barrier::init(&bars.empty_v[s], C::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (role == 0) {
    // ---------------------------------------------------------------- producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegs>();
    const int ptid = tid;
    const Element* kbase = static_cast<const Element*>(a.k) +
                           a.kv_offset(b, si, 0, hkv, a.k_batch_stride, a.k_token_stride, a.k_head_stride);
    const Element* vbase = static_cast<const Element*>(a.v) +
                           a.kv_offset(b, si, 0, hkv, a.v_batch_stride, a.v_token_stride, a.v_head_stride);
    for (int i = 0; i < count; ++i) {
      const int stage = i % kStages;
      const int phase = (i / kStages) & 1;
      const route::Route rt = routes[i];
      const int k0 = rt.index * p.tile_n;
      const int n_valid = min(p.tile_n, si.seqlen_kv - k0);
      Barrier::wait(&bars.empty_k[stage], phase ^ 1);
      produce_tile<T, false>(st, kbase, a.k_token_stride, k0, n_valid, stage, ptid);
      cp_async_arrive_noinc(&bars.full_k[stage]);
      Barrier::wait(&bars.empty_v[stage], phase ^ 1);
      produce_tile<T, true>(st, vbase, a.v_token_stride, k0, n_valid, stage, ptid);
      cp_async_arrive_noinc(&bars.full_v[stage]);
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups
  cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegs>();
  const int wg = role - 1;
  const int wg_tid = tid % 128;
  const int q_begin = q0 + wg * 64;
  unsigned present = 0;  // units of the tile that lie inside the sequence
  for (int u = 0; u * p.unit_m < T::kBlockM; ++u)
    if (q0 + u * p.unit_m < si.seqlen_q) present |= 1u << u;

  {  // This warpgroup's 64 Q rows.
    const Element* q = static_cast<const Element*>(a.q);
    constexpr int kChunks = kHeadDim / 8, kRowsPerStep = 128 / kChunks;
    Tensor sQ = make_tensor(make_smem_ptr(st.q[wg]), typename T::SmemLayoutQ{});
    const int d = (wg_tid % kChunks) * 8;
    CUTE_UNROLL
    for (int r0 = 0; r0 < 64; r0 += kRowsPerStep) {
      const int r = r0 + wg_tid / kChunks;
      const bool valid = q_begin + r < si.seqlen_q;
      cp_async_16(&sQ(r, d), valid ? q + a.q_offset(b, si, q_begin + r, h) + d : q, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 1 + wg);
  }

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
  clear(tOrO);
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
  Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor o_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor co_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  Tensor tOrP = make_tensor<Element>(acc_as_a_operand(tSrS.layout()));
  Tensor s_as_a = make_tensor(tSrS.data(), acc_as_a_operand(tSrS.layout()));
  constexpr int kRows = decltype(size<0>(s_rc))::value;
  constexpr bool kPingPong = T::kWarpgroups == 2;
  constexpr int kSchedBarrier0 = 3;  // named barriers 3, 4 (0: __syncthreads, 1-2: Q tiles)
  OnlineSoftmax<kRows> softmax(a.scale);
  const bool warp_leader = (tid % 32) == 0;

  auto mask_softmax = [&](int i, float (&rescale)[kRows]) {
    const route::Route rt = routes[i];
    RouteMask m;
    m.k0 = rt.index * p.tile_n;
    m.n_valid = min(p.tile_n, si.seqlen_kv - m.k0);
    m.rows = rt.rows;
    m.masked = rt.masked;
    if (rt.masked != 0 || (rt.rows & present) != present || m.n_valid < kBlockN) {
      m.q_begin = q_begin;
      m.tile_row0 = wg * 64;
      m.unit_m = p.unit_m;
      m.apply(s_rc, c_rc, a, si, b);
    }
    softmax.step(s_rc, rescale);
  };
  auto convert_p = [&]() {
    CUTE_UNROLL
    for (int e = 0; e < size(tOrP); ++e) tOrP(e) = static_cast<Element>(s_as_a(e));
  };
  auto wait_full = [&](std::uint64_t* full, int i) {
    Barrier::wait(&full[i % kStages], (i / kStages) & 1);
    cutlass::arch::fence_view_async_shared();
  };
  auto release = [&](std::uint64_t* empty, int i) {
    if (warp_leader) Barrier::arrive(&empty[i % kStages]);
  };

  if (count > 0) {
    wait_full(bars.full_k, 0);
    wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, 0), tSrS);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    release(bars.empty_k, 0);
    float rescale[kRows];
    mask_softmax(0, rescale);  // O is still zero: nothing to rescale
    convert_p();
    // Steady state: S(i+1) and PV(i) in flight together, the softmax of i+1 under PV(i).
    // Ping-pong (two consumer warpgroups): a warpgroup issues its two GEMMs only after the other
    // one issued its own, so one warpgroup's softmax runs under the other's GEMMs.
    if constexpr (kPingPong) {
      if (wg == 0) cutlass::arch::NamedBarrier::arrive(256, kSchedBarrier0);
    }
    CUTE_NO_UNROLL
    for (int i = 0; i < count - 1; ++i) {
      wait_full(bars.full_k, i + 1);
      if constexpr (kPingPong) cutlass::arch::NamedBarrier::sync(256, kSchedBarrier0 + wg);
      wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, (i + 1) % kStages), tSrS);
      wait_full(bars.full_v, i);
      wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, i % kStages), tOrO);
      if constexpr (kPingPong) cutlass::arch::NamedBarrier::arrive(256, kSchedBarrier0 + (1 - wg));
      warpgroup_wait<1>();  // S(i+1) done; PV(i) may still run
      warpgroup_fence_operand(tSrS);
      release(bars.empty_k, i + 1);
      mask_softmax(i + 1, rescale);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      release(bars.empty_v, i);
      scale_rows(o_rc, rescale);
      convert_p();
    }
    // Balance the ping-pong barriers (the first arrive, or the other warpgroup's last one).
    if constexpr (kPingPong) {
      if (wg == 0) cutlass::arch::NamedBarrier::sync(256, kSchedBarrier0);
    }
    // Last PV.
    wait_full(bars.full_v, count - 1);
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, (count - 1) % kStages), tOrO);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release(bars.empty_v, count - 1);
  }

  float inv[kRows], lse[kRows];
  softmax.finish(inv, lse, a.scale);
  scale_rows(o_rc, inv);
  store_output(o_rc, co_rc, lse, a, si, b, h, q_begin);
#endif
}

// a == nullptr: only raises the kernel's shared-memory limit (plan time, outside any graph capture).
template <class T>
cudaError_t launch_forward_ws(const AttentionParams* a, const int* overflow, cudaStream_t stream) {
  using C = WsConfig<T>;
  auto kernel = forward_kernel_ws<T>;
  if (!a) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  const int items = work_items(*a);
  if (items == 0) return cudaSuccess;
  kernel<<<items, C::kThreads, C::kSmemBytes, stream>>>(*a, overflow);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu::fwd
