// dQ of one step: dQ = dS K (kStepRows x D x kBlockN, from shared memory), added into the fp32
// accumulator (dq_accum; tiled where steps start at multiples of 64, dq_tiles.hpp, else
// [q_rows][Hq][D]; scaled and rounded by the conversion kernel in rows.cuh). Into the tiled
// accumulator each dQ warp stages its rows' block in shared memory (T::kDqBulk: 16-byte stores in
// fragment order, conflict-free) and its first lane adds the block with one bulk reduction
// (cp.reduce.async.bulk .add.f32, performed by the TMA unit), so the consumers issue no global
// reductions, their registers are free as soon as they are stored, and no warp waits for another;
// otherwise each thread adds its values with vector reductions.
// Two orders:
//  * default: vector reductions in whatever order the CTAs reach a row: fast, but the float sums
//    of a dQ element differ from run to run in the last bits;
//  * deterministic: the contributions to a (batch, head, Q tile) are added in the order of the
//    row's routes. A semaphore per (batch, head, Q tile) counts the routes added; the CTA of the
//    route at position j waits until it reads j, adds, and writes j + 1 after its last step of
//    that Q tile. A CTA waits only for CTAs of lower KV tiles of its own (batch, KV head), which
//    have lower block indices and so were started no later: no wait can close a cycle.
#pragma once
#include "gpu/backward.hpp"
#include "gpu/bwd/dq_tiles.hpp"
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

__device__ __forceinline__ void red_add_v2(float* p, float x, float y, bool pred) {
  if (pred) asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
}
// Adds `bytes` of shared memory into global memory (one bulk async-group).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;\n" ::"l"(dst),
               "r"(s), "r"(bytes)
               : "memory");
}
// Orders this thread's completed bulk operations on global memory with its generic accesses.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

__device__ __forceinline__ void red_add_v4(float* p, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

// Whether a thread's accumulator fragment (offsets of its values from its first, (row, column))
// is the SM90 fp32 layout dq_tiles.hpp assumes: value e at (8 ((e / 2) % 2), 8 (e / 4) + e % 2).
template <class Layout>
constexpr bool standard_fragment(Layout layout) {
  for (int e = 0; e < int(size(layout)); ++e) {
    const auto o = layout(e);
    if (int(get<0>(o)) != 8 * ((e / 2) % 2) || int(get<1>(o)) != 8 * (e / 4) + e % 2) return false;
  }
  return true;
}

// dQ = dS K of the step into `acc` (a fragment of T::MmaDQ over kStepRows x D), issued as one wgmma
// group and not waited for: the caller waits where it needs the result. Run by the dQ warpgroups;
// `slice`: 128 x the dQ warpgroup's index, warp-uniform (its operands depend on the warpgroup
// alone, so their descriptors stay in uniform registers). dS is in shared memory (st.ds[ds_buffer]).
template <class T, class Acc>
__device__ __forceinline__ void issue_dq_gemm(typename T::SharedStorage& st, int ds_buffer, Acc& acc, int slice) {
  typename T::MmaDQ mma;
  auto thr = mma.get_thread_slice(slice);
  Tensor sdS = make_tensor(make_smem_ptr(st.ds[ds_buffer]), typename T::SmemLayoutP{});
  Tensor sKt = make_tensor(make_smem_ptr(st.k), typename T::SmemLayoutKt{});
  wg_gemm<true, false>(mma, thr.partition_fragment_A(sdS), thr.partition_fragment_B(sKt), acc);
}

// The row-major accumulator [q_rows][Hq][D]: a thread holds, per row it touches, pairs of
// adjacent columns (checked in add_dq), so each pair is one 8-byte vector reduction
// (red.global.add.v2.f32) and the four threads of a quad cover 32 contiguous bytes of a row.
// Addresses from the thread's first element plus compile-time offsets (the fragment's layout is
// static), so each reduction costs one 64-bit add at most; rows past the sequence are skipped.
template <class T, class Acc, class Coords>
__device__ __forceinline__ void add_dq_rows(const Acc& acc, const Coords& c, const Step& step,
                                            const BackwardWorkspace& ws, std::int64_t packed_base,
                                            const route::RouteParams& p, const route::SeqInfo& si) {
  constexpr int kHeadDim = T::kHeadDim;
  const int rows = si.seqlen_q - step.q0;
  const std::int64_t row_stride = static_cast<std::int64_t>(p.heads_q) * kHeadDim;
  const int row0 = get<0>(c(0)), col0 = get<1>(c(0));
  float* base = ws.dq_accum + ((packed_base + step.q0 + row0) * p.heads_q + step.head) * kHeadDim + col0;
  const auto add = [&](auto all_rows) {
    CUTE_UNROLL
    for (int e = 0; e < size(acc); e += 2) {
      const auto offset = c.layout()(e);  // (row, column) offset from element 0, compile-time
      const int dr = get<0>(offset), dc = get<1>(offset);
      red_add_v2(base + dr * row_stride + dc, acc(e), acc(e + 1), decltype(all_rows)::value || row0 + dr < rows);
    }
  };
  // Block-uniform: every step but a sequence's last has all 64 rows (no predicates there).
  if (rows >= 64) add(std::true_type{});
  else add(std::false_type{});
}

// The thread of each dQ warp that issues the warp's bulk reductions (T::kDqBulk): a warp stages its
// rows' block (dq_tiles.hpp) and adds it itself, so no warp waits for the others (one leader per
// warpgroup made its warp the last of the four every step, and every wgmma waited for it:
// bench/RESULTS.md, 2026-12-03 17:00).
__device__ __forceinline__ bool dq_bulk_leader(int dq_tid) { return dq_tid % 32 == 0; }

// Where offset `offset` (floats, the step's tiled regions in order) of a step's staged dQ lies in
// shared memory: the staging buffer, or (solo consumers) the step's stage, its Q then its dO.
template <class T>
__device__ __forceinline__ float* dq_staging(typename T::SharedStorage& st, int stage, int offset) {
  if constexpr (T::kSolo) {
    constexpr int kStageElements = T::kStepRows * T::kHeadDim, kHalf = kStageElements / 2;  // floats in a Q
    const bool in_q = offset < kHalf;
    return reinterpret_cast<float*>((in_q ? st.q : st.dout) + stage * kStageElements) + (in_q ? offset : offset - kHalf);
  } else {
    return st.dq.data + offset;
  }
}

// The bulk reductions of a dQ warp's staged blocks (add_dq) by its leader: one for its warpgroup's
// region (dq_tid / 128), or a solo consumer's for each of its regions. `tile`: the step's tile in
// the accumulator, as add_dq returned it.
template <class T>
__device__ __forceinline__ void bulk_add_dq(typename T::SharedStorage& st, float* tile, int stage, int dq_tid) {
  if (!dq_bulk_leader(dq_tid)) return;
  constexpr int kColumns = T::kDqColumns;
  const int lane = dq_tid % 128, first = T::kSolo ? 0 : dq_tid / 128;
  CUTE_UNROLL
  for (int r = 0; r < T::kDqStagedRegions; ++r) {
    const int block = (first + r) * 64 * kColumns + dq_fragment_offset(lane, 0, kColumns) - (lane % 32) * 4;
    bulk_reduce_add(tile + block, dq_staging<T>(st, stage, block), 16 * kColumns * 4);
  }
}

// A dQ fragment's values into the step's staging, in the tiled accumulator's order (16-byte stores,
// conflict-free): region dq_tid / 128.
template <class T, class Acc>
__device__ __forceinline__ void stage_dq(const Acc& acc, typename T::SharedStorage& st, int stage, int dq_tid) {
  constexpr int kColumns = T::kDqColumns;
  const int base = dq_tid / 128 * 64 * kColumns;
  CUTE_UNROLL
  for (int j = 0; j < size(acc) / 4; ++j)
    *reinterpret_cast<float4*>(dq_staging<T>(st, stage, base + dq_fragment_offset(dq_tid % 128, j, kColumns))) =
        make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
}

// The bulk reductions of a warp's staged dQ (add_dq), issued by the caller: one step late where
// the staging buffer is the CTA's (right after the stores, the fence before them waited for them
// behind the dK GEMM's operand reads, Nsight Compute, 2026-12-05: ~10 % of the consumers' samples;
// a step later they have long landed and the fence runs under the next step's S and dP GEMMs),
// at once where it is the step's stage (solo), which the next step's loads wait for.
template <class T>
__device__ __forceinline__ void issue_staged_dq(typename T::SharedStorage& st, float* tile, int stage, int dq_tid) {
  cutlass::arch::fence_view_async_shared();  // the stores before the bulk reduction reads them
  __syncwarp();                              // the warp's staged block, fenced by each lane
  bulk_add_dq<T>(st, tile, stage, dq_tid);
}

// Adds the step's completed dQ fragment into the fp32 accumulator: the tiled one (dq_tiles.hpp;
// staged and bulk-added where T::kDqBulk) or the row-major one (add_dq_rows), in the deterministic
// order when asked. With bulk adds the staging must be free: the caller's leaders waited for their
// previous reductions' reads (fwd::bulk_store_wait<true>) before a barrier of both consumers, or
// (solo) the step's GEMMs have completed. Returns, where the block is staged for a bulk reduction in
// the default order, the step's tile in the accumulator: the caller issues the reductions
// (issue_staged_dq); else nullptr (added here, or nothing to add). A dQ warpgroup's region is 64
// rows by kDqColumns columns of the step: with 128-row steps (T::kDqSplitRows) its own 64-row
// tile, which it skips when those rows lie past the sequence (the next tile of the accumulator is
// another sequence's, or past its end). A solo consumer passes its last region here, its others
// staged before (stage_dq), and adds them all.
template <class T, class Acc>
__device__ __forceinline__ float* add_dq(const Acc& acc, typename T::SharedStorage& st, const Step& step, int stage,
                                         const BackwardWorkspace& ws, std::int64_t packed_base,
                                         const AttentionParams& a, const route::SeqInfo& si, int b,
                                         bool deterministic, bool record_done, int dq_tid, int order_barrier) {
  constexpr int kHeadDim = T::kHeadDim, kThreads = 128 * T::kDqWarpgroups;
  constexpr int kColumns = T::kDqColumns, kRegion = 64 * kColumns;  // a region of the tile
  typename T::MmaDQ mma;
  auto thr = mma.get_thread_slice(dq_tid);
  Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<T::kStepRows>, Int<kHeadDim>>{}));
  static_assert(decltype(size(acc))::value == kColumns / 2 &&
                    cute::is_same_v<std::decay_t<decltype(stride<0, 0>(c.layout()))>, std::decay_t<decltype(E<1>{})>>,
                "adjacent fragment values are adjacent columns of one row");
  static_assert(standard_fragment(decltype(c.layout()){}), "the accumulator layout dq_tiles.hpp assumes");

  const route::RouteParams& p = a.route;
  const bool tiled = ws.geometry.dq_tiles > 0, bulk = T::kDqBulk && tiled;
  const int region = dq_tid / 128, lane = dq_tid % 128;
  const bool rows_in_sequence = !T::kDqSplitRows || step.q0 + 64 * region < si.seqlen_q;  // warpgroup-uniform
  const auto tile = [&] {  // the step's tile in the accumulator
    const std::int64_t index = (dq_padded_start(p, b) + step.q0) / 64;
    return ws.dq_accum + dq_tile_offset(ws.geometry.dq_tiles, step.head, index, kHeadDim);
  };
  if constexpr (T::kDqBulk) {
    if (bulk) {
      stage_dq<T>(acc, st, stage, dq_tid);
      if (!deterministic) return rows_in_sequence ? tile() : nullptr;
      cutlass::arch::fence_view_async_shared();  // the stores before the bulk reduction reads them
    }
  }
  // Derived where used: computed once ahead of both uses, it cost every step ~14 instructions,
  // those of the default order too.
  const auto semaphore = [&] {
    return ws.semaphores + (static_cast<std::int64_t>(b) * p.heads_q + step.head) * p.max_q_tiles + step.route.q_tile;
  };
  const bool order_thread = (T::kSolo ? lane : dq_tid) == 0;  // waits for and moves the semaphore
  if (deterministic) {
    if (order_thread) {
      while (load_acquire(semaphore()) != step.route.position) {
      }
      fence_proxy_async_global();  // the earlier routes' adds before this one's bulk reduction
    }
    fwd::barrier_sync(order_barrier, kThreads);
  }
  if (tiled) {
    if constexpr (T::kDqBulk) {
      if (rows_in_sequence) bulk_add_dq<T>(st, tile(), stage, dq_tid);
    } else {
      // The fragment's values in order, 16 bytes per reduction, no predicates (rows past the
      // sequence hold zeros or are never converted: dq_tiles.hpp).
      float* dst = tile();
      CUTE_UNROLL
      for (int j = 0; j < size(acc) / 4; ++j)
        red_add_v4(dst + region * kRegion + dq_fragment_offset(lane, j, kColumns), acc(4 * j), acc(4 * j + 1),
                   acc(4 * j + 2), acc(4 * j + 3));
    }
  } else if constexpr (!T::kDqSplitRows && !T::kSolo) {  // these have tile_m % 64 == 0: always tiled
    add_dq_rows<T>(acc, c, step, ws, packed_base, p, si);
  }
  if (deterministic && record_done) {
    if (bulk && dq_bulk_leader(dq_tid)) {
      fwd::bulk_store_wait<false>();  // the bulk reduction has completed
      fence_proxy_async_global();
    }
    __threadfence();  // this thread's adds are performed before the semaphore moves on
    fwd::barrier_sync(order_barrier, kThreads);
    if (order_thread) store_release(semaphore(), step.route.position + 1);
  }
  return nullptr;
}

}  // namespace bsattn::gpu::bwd
