// The warp-specialised SM90 forward kernel: one producer warpgroup streams the K and V tiles of
// the row's routes into shared memory (cp.async completing on mbarriers, two stages each, K one
// route ahead of V) while kWarpgroups consumer warpgroups (64 query rows each) run
// S = Q K^T and O += P V with wgmma. Registers move to the consumers (setmaxnreg). Consumers
// never wait for each other: each waits on the stage barriers and releases the stages it read,
// so the two warpgroups drift apart and their softmax phases interleave with the other's GEMMs.
// Within a consumer, S(i+1) is issued before PV(i), so the softmax of route i+1 overlaps PV(i).
#pragma once
#include <cuda.h>

#include <cstdlib>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bsattn/attention_params.hpp"
#include "bsattn/route/prepare.hpp"
#include "gpu/fwd/epilogue.cuh"
#include "gpu/fwd/mask.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/softmax.cuh"
#include "gpu/fwd/traits.cuh"

// Ping-pong scheduling of two consumer warpgroups (compile-time; measured slower, so off).
#ifndef BSATTN_FWD_PINGPONG
#define BSATTN_FWD_PINGPONG 0
#endif

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

// Bulk tensor (TMA) descriptors of K and V as 4-D tensors (D, tokens, heads, batch); `valid`
// false: the producer falls back to cp.async (per-token addressing).
struct KVTensorMaps {
  CUtensorMap k, v;
  int valid;
};

__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, std::uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(s),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  const unsigned m = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(m), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(s) : "memory");
}

template <class T>
__global__ void __launch_bounds__(WsConfig<T>::kThreads, 1)
    forward_kernel_ws(const __grid_constant__ AttentionParams a, const int* __restrict__ overflow,
                      const __grid_constant__ KVTensorMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = WsConfig<T>;
  using Element = typename T::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kStages = T::kStages;
  constexpr bool kUseTma = kBlockN == 128;
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
      Barrier::init(&bars.full_k[s], kUseTma && maps.valid ? 1 : C::kProducerThreads);
      Barrier::init(&bars.full_v[s], kUseTma && maps.valid ? 1 : C::kProducerThreads);
      Barrier::init(&bars.empty_k[s], C::kConsumerWarps);
      Barrier::init(&bars.empty_v[s], C::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (role == 0) {
    // ---------------------------------------------------------------- producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegs>();
    // TMA producer for the 128-wide tiles; the 64-wide kernels keep the cp.async producer
    // (compiling both into them made ptxas spill heavily in the consumer code).
    if (kUseTma && maps.valid) {
      // One thread issues the bulk tensor copies: per route and operand, D/64 boxes of 64 x kBlockN
      // (128-byte swizzle, the layout the wgmma descriptors read). Tokens past the tensor are
      // zero-filled; tokens past the sequence but inside the tensor are finite data that the
      // route mask removes.
      if (tid == 0) {
        const int tok0 = p.varlen_kv ? static_cast<int>(si.kv_base) : 0;
        const int bc = p.varlen_kv ? 0 : b;
        constexpr unsigned kBytes = kBlockN * kHeadDim * sizeof(Element);
        for (int i = 0; i < count; ++i) {
          const int stage = i % kStages;
          const int phase = (i / kStages) & 1;
          const int k0 = routes[i].index * p.tile_n;
          Barrier::wait(&bars.empty_k[stage], phase ^ 1);
          arrive_expect_tx(&bars.full_k[stage], kBytes);
          CUTE_UNROLL
          for (int c = 0; c < kHeadDim / 64; ++c)
            tma_load_4d(st.k + (stage * kHeadDim + c * 64) * kBlockN, &maps.k, &bars.full_k[stage], c * 64,
                        tok0 + k0, hkv, bc);
          Barrier::wait(&bars.empty_v[stage], phase ^ 1);
          arrive_expect_tx(&bars.full_v[stage], kBytes);
          CUTE_UNROLL
          for (int c = 0; c < kHeadDim / 64; ++c)
            tma_load_4d(st.v + (stage * kHeadDim + c * 64) * kBlockN, &maps.v, &bars.full_v[stage], c * 64,
                        tok0 + k0, hkv, bc);
        }
      }
      return;
    }
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
  constexpr bool kPingPong = T::kWarpgroups == 2 && BSATTN_FWD_PINGPONG;
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
      m.template apply<kBlockN == 128>(s_rc, c_rc, a, si, b);
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

// Encodes the K and V tensor maps for this run (host only: no stream work, capturable).
// Returns false where TMA cannot address the tensors (paged KV, strides or bases not 16-byte
// aligned, no driver entry point); the kernel then loads with cp.async.
template <class T>
bool encode_kv_maps(const AttentionParams& a, std::int64_t kv_tokens, KVTensorMaps& maps) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = []() -> Encode {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode || a.route.paged) return false;
  const std::int64_t e = sizeof(typename T::Element);
  const auto one = [&](const void* base, std::int64_t bs, std::int64_t ts, std::int64_t hs, CUtensorMap& map) {
    const bool varlen = a.route.varlen_kv;
    cuuint64_t dims[4] = {static_cast<cuuint64_t>(T::kHeadDim),
                          static_cast<cuuint64_t>(kv_tokens),
                          static_cast<cuuint64_t>(a.route.heads_kv),
                          static_cast<cuuint64_t>(varlen ? 1 : a.route.batch)};
    cuuint64_t strides[3] = {static_cast<cuuint64_t>(ts * e), static_cast<cuuint64_t>(hs * e),
                             static_cast<cuuint64_t>((varlen ? ts * kv_tokens : bs) * e)};
    if (reinterpret_cast<std::uintptr_t>(base) % 16 || strides[0] % 16 || strides[1] % 16 || strides[2] % 16 ||
        strides[2] == 0 || dims[1] == 0 || dims[1] > (std::uint64_t(1) << 31))
      return false;
    cuuint32_t box[4] = {64, static_cast<cuuint32_t>(T::kBlockN), 1, 1};
    cuuint32_t estr[4] = {1, 1, 1, 1};
    return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box, estr,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return one(a.k, a.k_batch_stride, a.k_token_stride, a.k_head_stride, maps.k) &&
         one(a.v, a.v_batch_stride, a.v_token_stride, a.v_head_stride, maps.v);
}

// a == nullptr: only raises the kernel's shared-memory limit (plan time, outside any graph capture).
template <class T>
cudaError_t launch_forward_ws(const AttentionParams* a, std::int64_t kv_tokens, const int* overflow,
                              cudaStream_t stream) {
  using C = WsConfig<T>;
  auto kernel = forward_kernel_ws<T>;
  if (!a) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  const int items = work_items(*a);
  if (items == 0) return cudaSuccess;
  KVTensorMaps maps{};
  static const bool no_tma = std::getenv("BSATTN_GPU_NO_TMA") != nullptr;
  maps.valid = T::kBlockN == 128 && !no_tma && encode_kv_maps<T>(*a, kv_tokens, maps) ? 1 : 0;
  kernel<<<items, C::kThreads, C::kSmemBytes, stream>>>(*a, overflow, maps);
  return cudaGetLastError();
}

}  // namespace bsattn::gpu::fwd
