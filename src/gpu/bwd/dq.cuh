// dQ of one step: dQ = dS K (64 x D x kBlockN, from shared memory), added into the fp32
// accumulator [q_rows][Hq][D] (dq_accum; scaled and rounded by the conversion kernel in rows.cuh).
// Two orders:
//  * default: atomic adds (red.global.add.f32) in whatever order the CTAs reach a row: fast, but
//    the float sums of a dQ element differ from run to run in the last bits;
//  * deterministic: the contributions to a (batch, head, Q tile) are added in the order of the
//    row's routes. A semaphore per (batch, head, Q tile) counts the routes added; the CTA of the
//    route at position j waits until it reads j, adds, and writes j + 1 after its last step of
//    that Q tile. A CTA waits only for CTAs of lower KV tiles of its own (batch, KV head), which
//    have lower block indices and so were started no later: no wait can close a cycle.
#pragma once
#include "gpu/backward.hpp"
#include "gpu/bwd/steps.cuh"
#include "gpu/bwd/traits.cuh"

namespace bsattn::gpu::bwd {

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// Run by the dQ warpgroups (dq_tid: thread index among them). dS is in shared memory (st.ds).
template <class T>
__device__ __forceinline__ void accumulate_dq(typename T::SharedStorage& st, const Step& step,
                                              const BackwardWorkspace& ws, std::int64_t packed_base,
                                              const AttentionParams& a, const route::SeqInfo& si, int b,
                                              bool deterministic, bool record_done, int dq_tid) {
  constexpr int kHeadDim = T::kHeadDim, kThreads = 128 * T::kDqWarpgroups;
  constexpr int kOrderBarrier = 1;  // named barrier of the dQ warpgroups (0 is __syncthreads)
  typename T::MmaDQ mma;
  auto thr = mma.get_thread_slice(dq_tid);
  Tensor sdS = make_tensor(make_smem_ptr(st.ds), typename T::SmemLayoutP{});
  Tensor sKt = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutKt{});
  Tensor tA = thr.partition_fragment_A(sdS);
  Tensor tB = thr.partition_fragment_B(sKt);
  Tensor acc = partition_fragment_C(mma, Shape<_64, Int<kHeadDim>>{});
  wg_gemm<true, false>(mma, tA, tB, acc);
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  const route::RouteParams& p = a.route;
  const int heads = p.heads_q;
  int* semaphore = ws.semaphores + (static_cast<std::int64_t>(b) * heads + step.head) * p.max_q_tiles + step.route.q_tile;
  if (deterministic) {
    if (dq_tid == 0)
      while (load_acquire(semaphore) != step.route.position) {
      }
    fwd::barrier_sync(kOrderBarrier, kThreads);
  }
  Tensor c = thr.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
  const int rows = si.seqlen_q - step.q0;
  float* dst = ws.dq_accum + ((packed_base + step.q0) * heads + step.head) * kHeadDim;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int row = get<0>(c(e));
    if (row < rows) atomicAdd(dst + static_cast<std::int64_t>(row) * heads * kHeadDim + get<1>(c(e)), acc(e));
  }
  if (deterministic && record_done) {
    __threadfence();  // this thread's adds are performed before the semaphore moves on
    fwd::barrier_sync(kOrderBarrier, kThreads);
    if (dq_tid == 0) store_release(semaphore, step.route.position + 1);
  }
}

}  // namespace bsattn::gpu::bwd
