// The SM90 backward kernel. One CTA per (KV tile, KV head, batch): K and V stay in shared memory
// while the CTA walks, for every query head of the KV head's group, the Q tiles that attend this
// KV tile (the column stream, steps.cuh) in steps of 64 rows. Per step:
//   S = Q K^T and dP = dO V^T issued (both warpgroups, KV columns split); under them the walk
//   finds the next step and its Q, dO, LSE and delta go into the other stage (loader.cuh); once S
//   is complete the forward's route mask (mask.cuh) and P = exp2(S * scale * log2(e) - LSE *
//   log2(e)), P to shared memory (stmatrix) while dP completes; dS = P (dP - delta) to shared
//   memory; then dQ = dS K (dq.cuh) and dV += P^T dO (warpgroup 0), dK += dS^T Q (warpgroup 1),
//   dQ's adds into the fp32 accumulator (vector reductions, or in route order) running under the
//   dK / dV GEMM (D 256: after it; Traits::kDqFirst).
// dK and dV stay in registers over the whole walk (the group's query heads summed there, GQA) and
// are stored once (epilogue.cuh). Two block-wide barriers per step (the stage has landed and the
// previous step's GEMMs are done; P and dS are in shared memory). No warp specialisation yet: all
// 256 threads load with cp.async and compute.
#pragma once
#include <cutlass/arch/barrier.h>

#include "bsattn/backward_params.hpp"
#include "gpu/backward.hpp"
#include "gpu/bwd/dq.cuh"
#include "gpu/bwd/epilogue.cuh"
#include "gpu/bwd/loader.cuh"
#include "gpu/bwd/steps.cuh"
#include "gpu/bwd/traits.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/softmax.cuh"

namespace bsattn::gpu::bwd {

// kTokenTensors: the forward's mask policy (RouteMask::apply), picked by problem at launch.
template <class T, bool kTokenTensors>
__global__ void __launch_bounds__(T::kThreads, 1)
    backward_kernel(const __grid_constant__ BackwardParams g, const __grid_constant__ BackwardWorkspace ws,
                    const int* __restrict__ overflow, int deterministic, int max_kv_tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename T::Element;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  extern __shared__ char smem_raw[];
  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  auto& st = *reinterpret_cast<typename T::SharedStorage*>(smem_raw + ((1024u - smem_base % 1024u) % 1024u));
  if (*overflow != 0) return;  // an overflowing run writes nothing (Plan::check reports it)

  const AttentionParams& a = g.fwd;
  const route::RouteParams& p = a.route;
  const int kv_tile = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  const route::SeqInfo si = route::seq_info(p, b);
  const int k0 = kv_tile * p.tile_n;
  // K/V rows the sequence owns: with seqused_k a packed sequence is longer than its attended
  // part, and that tail gets zero gradients (as on the CPU engine).
  const int owned = p.varlen_kv ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : si.seqlen_kv;
  const int n_valid = max(0, min(p.tile_n, si.seqlen_kv - k0));
  // A tile with routes is walked even past the owned rows (unvalidated lengths): the
  // deterministic dQ order waits for every route of a row.
  if (k0 >= owned && n_valid == 0) return;
  const int tid = threadIdx.x, wg = tid / 128;

  const StepWalk walk =
      StepWalk::for_cta(p, ws.columns, ws.column_counts, max_kv_tiles, b, hkv, kv_tile, si.seqlen_q);
  const std::int64_t q_rows = ws.geometry.q_rows;
  const std::int64_t packed_base = p.varlen_q ? si.q_base : static_cast<std::int64_t>(b) * p.max_seqlen_q;

  typename T::MmaSdP mma_sdp;
  typename T::MmaDKV mma_dkv;
  Tensor acc_dkv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dkv);
  const float scale_log2 = a.scale * float(M_LOG2E);

  Step step;
  bool have = n_valid > 0 && walk.first(step);
  if (have) {
    load_kv<T>(st, a, b, si, k0, n_valid, hkv, tid);
    load_step<T>(st, g, b, si, step, 0, ws.lse_log2, ws.delta, q_rows, tid);
    cp_async_commit();
  }
  for (int i = 0; have; ++i) {
    const int stage = i % T::kStages;
    fwd::cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();  // cp.async writes before the wgmma (async proxy) reads
    __syncthreads();  // every thread's loads landed; the previous step's GEMMs are done everywhere

    // Thread-dependent operand views are derived per step from an opaque thread index: hoisted
    // out of the step loop, their descriptors and addresses would stay live across it and spill.
    const int ltid = fwd::opaque_thread_index();
    auto thr_sdp = mma_sdp.get_thread_slice(ltid);
    auto thr_dkv = mma_dkv.get_thread_slice(ltid % 128);
    Tensor sQ = make_tensor(make_smem_ptr(st.q), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.dout), typename T::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(st.v), typename T::SmemLayoutK{});
    Tensor sP = make_tensor(make_smem_ptr(st.p), typename T::SmemLayoutP{});
    Tensor sdS = make_tensor(make_smem_ptr(st.ds), typename T::SmemLayoutP{});
    // dV += P^T dO on warpgroup 0, dK += dS^T Q on warpgroup 1: one GEMM shape, other operands.
    const bool dv_warpgroup = ltid < 128;
    Tensor sPt_or_dSt = make_tensor(make_smem_ptr(dv_warpgroup ? st.p : st.ds), typename T::SmemLayoutPt{});
    Tensor sdOt_or_Qt = make_tensor(make_smem_ptr(dv_warpgroup ? st.dout : st.q), typename T::SmemLayoutQt{});
    Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
    Tensor tSrK = thr_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
    Tensor tKVrA = thr_dkv.partition_fragment_A(sPt_or_dSt);
    Tensor tKVrB = thr_dkv.partition_fragment_B(sdOt_or_Qt);

    // S and dP.
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<_64, Int<kBlockN>>{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<_64, Int<kBlockN>>{});
    wg_gemm<true, false>(mma_sdp, tSrQ(_, _, _, stage), tSrK, tSrS);
    wg_gemm<true, false>(mma_sdp, tdPrdO(_, _, _, stage), tdPrV, tdPrdP);
    // The next step (the walk reads its column record from global memory) and its loads into the
    // other stage, while the tensor cores run S and dP: the stage's last readers (the previous
    // step's GEMMs) completed before the barrier above.
    Step next = step;
    const bool have_next = walk.next(next);
    if (have_next) {
      load_step<T>(st, g, b, si, next, stage ^ 1, ws.lse_log2, ws.delta, q_rows, ltid);
      cp_async_commit();
    }
    // S is complete (dP may still run): the route mask exactly as in the forward, P, and P to
    // shared memory under the dP GEMM; then dS.
    warpgroup_wait<1>();
    warpgroup_fence_operand(tSrS);
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor s_rc = make_tensor(tSrS.data(), fwd::acc_rowcol(tSrS.layout()));
    Tensor dp_rc = make_tensor(tdPrdP.data(), fwd::acc_rowcol(tdPrdP.layout()));
    Tensor c_rc = make_tensor(cS.data(), fwd::acc_rowcol(cS.layout()));
    const ColumnRoute& route = step.route;
    const unsigned units = walk.step_units(step.sub);
    if ((route.masked & units) != 0 || (route.rows & units) != units || step.q0 + 64 > si.seqlen_q ||
        n_valid < kBlockN) {
      fwd::RouteMask m;
      m.q_begin = step.q0;
      m.tile_row0 = step.sub * 64;
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
    // P and dS to shared memory in the input dtype by stmatrix (8 x 8 matrices, 16 bytes per
    // thread and instruction).
    auto copy_pds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_copy = copy_pds.get_thread_slice(ltid);
    {
      Tensor rP = make_fragment_like<Element>(tSrS);
      CUTE_UNROLL
      for (int e = 0; e < size(tSrS); ++e) rP(e) = static_cast<Element>(tSrS(e));
      cute::copy(copy_pds, thr_copy.retile_S(rP), thr_copy.partition_D(sP));
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdPrdP);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s_rc); ++r) {
      const float delta = st.delta[stage][get<0>(c_rc(r, 0))];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - delta);
    }
    {
      Tensor rdS = make_fragment_like<Element>(tdPrdP);
      CUTE_UNROLL
      for (int e = 0; e < size(tdPrdP); ++e) rdS(e) = static_cast<Element>(tdPrdP(e));
      cute::copy(copy_pds, thr_copy.retile_S(rdS), thr_copy.partition_D(sdS));
    }
    cutlass::arch::fence_view_async_shared();  // P and dS (generic-proxy stores) before the wgmma reads
    __syncthreads();

    // dV or dK, and dQ.
    const bool record_done = !have_next || next.head != step.head || next.record != step.record;
    if constexpr (T::kDqFirst) {
      // dQ first: its adds then run while the tensor cores work on dV / dK.
      Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<_64, Int<kHeadDim>>{});
      issue_dq_gemm<T>(st, acc_dq, ltid);
      wg_gemm<false, false>(mma_dkv, tKVrA, tKVrB(_, _, _, stage), acc_dkv);
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_dq);
      add_dq<T>(acc_dq, step, ws, packed_base, a, si, b, deterministic != 0, record_done, ltid);
    } else if constexpr (T::kDqWarpgroups == 1) {
      // D 64: warpgroup 1 alone computes dQ; it issues dQ first and adds under its dK GEMM.
      if (wg == 1) {
        Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<_64, Int<kHeadDim>>{});
        issue_dq_gemm<T>(st, acc_dq, ltid - 128);
        wg_gemm<false, false>(mma_dkv, tKVrA, tKVrB(_, _, _, stage), acc_dkv);
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc_dq);
        add_dq<T>(acc_dq, step, ws, packed_base, a, si, b, deterministic != 0, record_done, ltid - 128);
      } else {
        wg_gemm<false, false>(mma_dkv, tKVrA, tKVrB(_, _, _, stage), acc_dkv);
      }
    } else {
      wg_gemm<false, false>(mma_dkv, tKVrA, tKVrB(_, _, _, stage), acc_dkv);
      if (wg >= T::kDqWarpgroup0) {
        const int dq_tid = ltid - 128 * T::kDqWarpgroup0;
        Tensor acc_dq = partition_fragment_C(typename T::MmaDQ{}, Shape<_64, Int<kHeadDim>>{});
        issue_dq_gemm<T>(st, acc_dq, dq_tid);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq);
        add_dq<T>(acc_dq, step, ws, packed_base, a, si, b, deterministic != 0, record_done, dq_tid);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dkv);
    step = next;
    have = have_next;
  }
  store_dkv<T>(acc_dkv, mma_dkv.get_thread_slice(tid % 128), g, si, b, hkv, k0, max(0, min(p.tile_n, owned - k0)), wg);
#endif
}

template <class T, bool kTokenTensors>
cudaError_t launch_kernel(const BackwardParams& g, const BackwardWorkspace& ws, const int* overflow,
                          bool deterministic, cudaStream_t stream) {
  const route::RouteParams& p = g.fwd.route;
  const int max_kv_tiles = route::ceil_div(p.max_seqlen_kv, p.tile_n);
  const dim3 grid(max_kv_tiles, p.heads_kv, p.batch);
  backward_kernel<T, kTokenTensors>
      <<<grid, T::kThreads, T::kSmemBytes, stream>>>(g, ws, overflow, deterministic ? 1 : 0, max_kv_tiles);
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
