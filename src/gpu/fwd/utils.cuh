// Small device helpers of the SM90 forward kernel: cp.async, wgmma issue, named barriers (the
// fragment layout views: fragment_views.cuh).
#pragma once
#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "gpu/fwd/fragment_views.cuh"

namespace bsattn::gpu::fwd {

using namespace cute;

// 16-byte global -> shared copy; pred false writes zeros (the source is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
// 4-byte global -> shared copy (rows of fp32 per-row values); pred false writes zero.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Arrives on the mbarrier once this thread's earlier cp.async copies have landed; the arrival is
// counted in the barrier's init count (noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(s) : "memory");
}

// A zero that ptxas cannot fold: every kernel that issues wgmma here launches one-dimensional
// blocks.
__device__ __forceinline__ std::uint32_t launch_zero() { return blockDim.y - 1; }

// The shared-memory descriptors of k block `k` of a descriptor fragment (V, M, K), as registers:
// the fragment's whole 64-bit descriptor plus the block's offset, in one 64-bit add (UIADD3.64)
// per descriptor. The offset stays inside the 14-bit start address field (shared memory), so it
// never carries. The high word is hidden from ptxas (XOR with launch_zero): seen as the constant
// it is, ptxas split the add into a carrying 32-bit pair and re-issued a UMOV of the constant
// before every HGMMA (4 instructions per QK HGMMA for its two descriptors, now 2); CuTe's own
// iterator (low word only) also re-issued the UMOV.
template <class T>
__device__ __forceinline__ auto k_block_descs(T const& t, int k) {
  Tensor d = make_tensor<uint64_t>(shape(t(_, _, 0)));
  const uint64_t base = t.data().desc_.desc_ ^ (uint64_t(launch_zero()) << 32);
  CUTE_UNROLL
  for (int i = 0; i < size(d); ++i) d(i) = base + uint32_t(t.layout()(i + size(d) * k));
  return d;
}

// One warpgroup GEMM: C (+)= A * B over every k block, committed as one wgmma group. The caller
// waits (warpgroup_wait) where the result is needed, so GEMMs can stay in flight across work.
// kRegA: A is a register fragment (RS wgmma); else both operands are shared-memory descriptors.
template <bool kZeroInit, bool kRegA, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    if constexpr (kRegA) cute::gemm(mma, a(_, _, k), k_block_descs(b, k), c);
    else cute::gemm(mma, k_block_descs(a, k), k_block_descs(b, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// This thread's bulk operations issued so far form a group (the waits below count groups).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's committed bulk groups have read shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk operations (stores, reductions) have read shared memory (kRead) or completed.
template <bool kRead>
__device__ __forceinline__ void bulk_store_wait() {
  if constexpr (kRead) {
    bulk_commit();
    bulk_wait_read();
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

// Named barriers by their hardware id (1-15; 0 is __syncthreads). CUTLASS's NamedBarrier adds
// its reserved count (8) to user ids, which leaves too few for this kernel's eleven. The
// non-.aligned forms: a warp counts once, with its non-exited threads (the TMA loader is one
// thread of its warp, and lanes of the tile warp and of the consumers diverge before some of
// them); `bar` (.aligned) there is undefined, and compute-sanitizer's synccheck reports it.
__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Cluster-wide barrier, per thread (not .aligned: threads of a warp may arrive apart), whole or
// in its two halves (arrive early, wait late).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync_threads() {
  cluster_arrive();
  cluster_wait();
}

// mbarrier arrival of the threads for which `pred` holds, as one predicated instruction (an `if`
// around the arrival opened a divergent region per pipeline step in the consumers' loop).
__device__ __forceinline__ void arrive_if(std::uint64_t* bar, bool pred) {
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(m),
               "r"(static_cast<int>(pred))
               : "memory");
}

// mbarrier transaction bytes: arrive and expect them, or only expect them (the arrival comes later).
__device__ __forceinline__ void arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(m), "r"(bytes) : "memory");
}
__device__ __forceinline__ void expect_tx(std::uint64_t* bar, unsigned bytes) {
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(m), "r"(bytes) : "memory");
}
// Waits for `phase` of a barrier whose completion other CTAs of the cluster release (st.async's
// complete_tx releases at cluster scope; the default wait acquires at CTA scope only).
__device__ __forceinline__ void wait_cluster_release(std::uint64_t* bar, int phase) {
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(m), "r"(phase)
      : "memory");
}

// Distributed shared memory: this CTA's shared address `local` in the CTA of cluster rank `rank`,
// and stores there that complete on that CTA's mbarrier (`remote_bar`, a mapped address too).
__device__ __forceinline__ unsigned peer_address(const void* local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
  return remote;
}
__device__ __forceinline__ void st_async(unsigned remote, float2 v, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(remote),
               "f"(v.x), "f"(v.y), "r"(remote_bar)
               : "memory");
}
__device__ __forceinline__ void st_async(unsigned remote, float v, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(remote), "f"(v),
               "r"(remote_bar)
               : "memory");
}

// Whether a warp-specialised CTA's register split can be reached by setmaxnreg: registers move
// only within the CTA's own allocation (its threads x the launch count, 64 K per SM shared by
// ctas_per_sm CTAs, in steps of 8), so what the consumers gain must not exceed what the producer
// gives back, or their setmaxnreg.inc waits forever.
constexpr bool register_split_fits(int producer_threads, int producer_regs, int consumer_threads, int consumer_regs,
                                   int ctas_per_sm = 1) {
  const int launch = 65536 / ctas_per_sm / (producer_threads + consumer_threads) / 8 * 8;
  return producer_threads * (launch - producer_regs) >= consumer_threads * (consumer_regs - launch);
}

// threadIdx.x through volatile asm: the compiler cannot hoist what is derived from it out of a loop.
__device__ __forceinline__ int opaque_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace bsattn::gpu::fwd
