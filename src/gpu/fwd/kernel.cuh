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

  using L = Loader<T>;
  L::load_q(st, a, si, b, h, q0, tid);
  cp_async_commit();
  auto route_tile = [&](int i, int& k0, int& n_valid) {
    const route::Route rt = routes[i];
    k0 = rt.index * p.tile_n;
    n_valid = min(p.tile_n, si.seqlen_kv - k0);
  };
  if (count > 0) {
    int k0, n_valid;
    route_tile(0, k0, n_valid);
    L::load_kv(st, a, si, b, hkv, k0, n_valid, 0, tid);
  }
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
  constexpr int kRows = decltype(size<0>(s_rc))::value;

  OnlineSoftmax<kRows> softmax(a.scale);
  const int q_begin = q0 + wg * 64;

  for (int i = 0; i < count; ++i) {
    const route::Route rt = routes[i];
    const int stage = i % T::kStages;
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    if (i + 1 < count) {
      int k0n, nn;
      route_tile(i + 1, k0n, nn);
      L::load_kv(st, a, si, b, hkv, k0n, nn, (i + 1) % T::kStages, tid);
    }
    cp_async_commit();
    if (rt.kind != static_cast<std::uint8_t>(route::RouteKind::exact)) continue;  // proxies: CPU only for now

    wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
    warpgroup_wait<0>();

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

    float rescale[kRows];
    softmax.step(s_rc, rescale);
    scale_rows(o_rc, rescale);

    Tensor tOrP = make_tensor<Element>(acc_as_a_operand(tSrS.layout()));
    Tensor s_as_a = make_tensor(tSrS.data(), acc_as_a_operand(tSrS.layout()));
    CUTE_UNROLL
    for (int e = 0; e < size(tOrP); ++e) tOrP(e) = static_cast<Element>(s_as_a(e));
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrO);
    warpgroup_wait<0>();
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
cudaError_t launch_forward(const AttentionParams* a, const int* overflow, cudaStream_t stream) {
  auto kernel = forward_kernel<T>;
  if (!a) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  const int items = work_items(*a);
  if (items == 0) return cudaSuccess;
  kernel<<<items, T::kThreads, T::kSmemBytes, stream>>>(*a, overflow);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu::fwd
