// The SM90 forward kernel: one CTA per (route row, query head); kWarpgroups consumer warpgroups
// of 64 query rows each walk the row's route records in order. Per route: S = Q K^T (wgmma, both
// operands in shared memory), the route mask where the route needs one, online softmax in
// registers, O += P V (wgmma, P from registers). K/V tiles are double-buffered: the next route's
// tile is loaded while the current one is computed.
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/epilogue.cuh"
#include "gpu/fwd/load.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/softmax.cuh"
#include "gpu/fwd/traits.cuh"

namespace bsattn::gpu::fwd {

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    forward_kernel(const __grid_constant__ AttentionParams a, const int* __restrict__ overflow) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename T::Element;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  extern __shared__ char smem_raw[];
  auto& st = *reinterpret_cast<typename T::SharedStorage*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) &
                                                            ~std::uintptr_t(1023));
  // A run whose route preparation overflowed writes nothing (Plan::check reports it).
  if (*overflow != 0) return;

  const route::RouteParams& p = a.route;
  const WorkItem w = work_item(a, blockIdx.x);
  const route::RowCoordinates rc = route::row_coordinates(p, w.row);
  const route::SeqInfo si = route::seq_info(p, rc.b);
  const int q0 = rc.q_tile * p.tile_m;
  if (q0 >= si.seqlen_q) return;
  const int b = rc.b, h = w.head, hkv = h / (p.heads_q / p.heads_kv);
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int wg_tid = tid % 128;

  const route::Route* routes = a.routes + static_cast<std::int64_t>(w.row) * p.capacity;
  const int count = a.route_counts[w.row];
  unsigned present = 0;  // units of the tile that lie inside the sequence
  for (int u = 0; u * p.unit_m < T::kBlockM; ++u)
    if (q0 + u * p.unit_m < si.seqlen_q) present |= 1u << u;

  // Loads: K runs one route ahead of V, so that S(i+1) = Q K(i+1)^T is issued before O += P(i) V(i)
  // and the softmax of route i+1 overlaps that PV GEMM on the tensor cores.
  using L = Loader<T>;
  auto route_tile = [&](int i, int& k0, int& n_valid) {
    const route::Route rt = routes[i];
    k0 = rt.index * p.tile_n;
    n_valid = min(p.tile_n, si.seqlen_kv - k0);
  };
  auto load = [&](auto is_v, int i) {
    int k0, n_valid;
    route_tile(i, k0, n_valid);
    L::template load_kv<decltype(is_v)::value>(st, a, si, b, hkv, k0, n_valid, i % T::kStages, tid);
  };
  L::load_q(st, a, si, b, h, q0, tid);
  if (count > 0) load(false_type{}, 0);
  cp_async_commit();
  if (count > 0) load(true_type{}, 0);
  if (count > 1) load(false_type{}, 1);
  cp_async_commit();

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

  OnlineSoftmax<kRows> softmax(a.scale);
  const int q_begin = q0 + wg * 64;

  // Route mask (only where the route needs one), then the online softmax of S.
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
      m.template apply<kBlockN == 128>(s_rc, c_rc, a, si, b);
    }
    softmax.step(s_rc, rescale);
  };
  auto convert_p = [&]() {
    CUTE_UNROLL
    for (int e = 0; e < size(tOrP); ++e) tOrP(e) = static_cast<Element>(s_as_a(e));
  };

  if (count > 0) {
    cp_async_wait<1>();  // Q and K(0)
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, 0), tSrS);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    float rescale[kRows];
    mask_softmax(0, rescale);  // O is still zero: nothing to rescale
    convert_p();
    CUTE_NO_UNROLL
    for (int i = 0; i < count; ++i) {
      // V(i) and K(i+1) have landed; every warpgroup is done with S(i) and with PV(i-1), so the
      // stages they read can be refilled.
      cp_async_wait<0>();
      cutlass::arch::fence_view_async_shared();
      __syncthreads();
      if (i + 1 < count) load(true_type{}, i + 1);
      if (i + 2 < count) load(false_type{}, i + 2);
      cp_async_commit();
      if (i + 1 == count) break;
      wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, (i + 1) % T::kStages), tSrS);
      wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, i % T::kStages), tOrO);
      warpgroup_wait<1>();  // S(i+1) done; PV(i) may still run
      warpgroup_fence_operand(tSrS);
      mask_softmax(i + 1, rescale);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      scale_rows(o_rc, rescale);
      convert_p();
    }
    // Last PV (its V landed at the last barrier).
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, (count - 1) % T::kStages), tOrO);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
  }
  cp_async_wait<0>();

  float inv[kRows], lse[kRows];
  softmax.finish(inv, lse, a.scale);
  scale_rows(o_rc, inv);
  store_output(o_rc, co_rc, lse, a, si, b, h, q_begin);
#endif
}

// a == nullptr: only raises the kernel's shared-memory limit (plan time, outside any graph capture).
template <class T>
cudaError_t launch_forward(const AttentionParams* a, std::int64_t, const int* overflow, cudaStream_t stream) {
  auto kernel = forward_kernel<T>;
  if (!a) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  const int items = work_items(*a);
  if (items == 0) return cudaSuccess;
  kernel<<<items, T::kThreads, T::kSmemBytes, stream>>>(*a, overflow);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu::fwd
