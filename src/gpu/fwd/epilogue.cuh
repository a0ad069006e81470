// Epilogue: normalised O goes through shared memory (a 64 x D buffer the caller holds: the last
// route's K or V stage) so that global writes are whole row segments rather than 4-byte fragments
// scattered over 8 rows (measured 2-9 % faster than direct stores); LSE is stored from registers.
// Rows past the sequence end are not stored.
// The staging layout is that of 128-byte-swizzled bulk tensor boxes (64 rows x 128 bytes each),
// so a 16-bit O whose 64 rows all lie in the sequence leaves with D/64 bulk tensor stores issued
// by one thread: the warpgroup does not wait for the global writes, only that thread waits until
// the copy has read the buffer (the buffer goes back to the producer after), or, in a buffer the
// warpgroup owns (kOwnBuffer), waits before the buffer's next use. Other tiles, and a 4-byte O,
// are copied by the warpgroup's threads in 16-byte row segments.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bsattn/attention_params.hpp"
#include "gpu/fwd/decode.cuh"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

// Two adjacent columns of O, converted to the output type (shared or global memory).
template <class Out>
__device__ __forceinline__ void store_pair(void* dst, float x, float y) {
  if constexpr (sizeof(Out) == 4) *reinterpret_cast<float2*>(dst) = make_float2(x, y);
  else if constexpr (std::is_same_v<Out, __half>) *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(x, y);
  else *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
}

// Byte offset of (row, byte within the staged row) in 128-byte-swizzled boxes of 64 rows: the
// 16-byte chunks of a box row are permuted by (row % 8), so that the fragment writes (8 rows per
// instruction) and the row reads are free of bank conflicts.
__device__ __forceinline__ int staged_offset(int row, int byte) {
  return (byte / 128) * (64 * 128) + row * 128 + ((((byte % 128) / 16) ^ (row & 7)) * 16) + byte % 16;
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2,
                                             int c3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(s), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// One warpgroup's 64 x kHeadDim output rows (row r: token q_begin + rows.token(r) of head
// h + rows.head(r)). `stage` holds 64 x kHeadDim 16-bit elements: a 4-byte output type is staged
// in two column halves. `o_map`: the bulk tensor map of O (16-bit outputs), or null. The validator
// guarantees O's base and strides are 16-byte aligned (SPEC: vector access). `shift`: elements
// added to O's offsets (a decode split's partial result).
template <class Out, int kHeadDim, bool kOwnBuffer, bool kPacked, class TO, class TC>
__device__ __forceinline__ void store_tile(const TO& o, const TC& c, const TC& c0, char* stage, const AttentionParams& a,
                                           const CUtensorMap* o_map, const route::SeqInfo& si, int b, int h,
                                           int q_begin, TileRows<kPacked> rows, std::int64_t shift, int wg_tid,
                                           int barrier_id) {
  constexpr int kPasses = sizeof(Out) / 2;
  constexpr int kCols = kHeadDim / kPasses;      // output columns per pass
  constexpr int kRowBytes = kHeadDim * 2;        // staged bytes per row
  constexpr int kChunks = kRowBytes / 16;        // 16-byte chunks per row (>= 8)
  constexpr int kPerChunk = 16 / sizeof(Out);
  const bool bulk = kPasses == 1 && o_map != nullptr && q_begin + rows.tokens() <= si.seqlen_q;
  if constexpr (kOwnBuffer) {  // the last tile's bulk store has read the buffer
    if (wg_tid == 0) bulk_wait_read();
    barrier_sync(barrier_id, 128);
  }
  CUTE_UNROLL
  for (int pass = 0; pass < kPasses; ++pass) {
    CUTE_UNROLL
    for (int i = 0; i < size<0>(o); ++i) {
      CUTE_UNROLL
      for (int j = 0; j < size<1>(o); j += 2) {
        // The pass of a pair, from thread 0's coordinates (`c0`): every thread's columns of a
        // wgmma C fragment lie in the fragment's 8 columns, so the pass is the same for all and
        // known at compile time (from `c`, which comes from an opaque thread index, ptxas kept
        // a branch per pair: 64 per tile of a 4-byte output).
        if (kPasses > 1 && get<1>(c0(i, j)) / kCols != pass) continue;
        const int r = get<0>(c(i, j)), col = get<1>(c(i, j)) - pass * kCols;
        store_pair<Out>(stage + staged_offset(r, col * static_cast<int>(sizeof(Out))), o(i, j), o(i, j + 1));
      }
    }
    if (bulk) {
      cutlass::arch::fence_view_async_shared();  // the writes above, before the bulk copy reads them
      barrier_sync(barrier_id, 128);
      if (wg_tid == 0) {
        const int token = (a.route.varlen_q ? static_cast<int>(si.q_base) : 0) + q_begin;
        CUTE_UNROLL
        for (int box = 0; box < kHeadDim / 64; ++box)
          tma_store_4d(o_map, stage + box * 64 * 128, box * 64, token, h, a.route.varlen_q ? 0 : b);
        if constexpr (kOwnBuffer) bulk_commit();
        else bulk_store_wait<true>();
      }
      return;
    }
    barrier_sync(barrier_id, 128);
    for (int idx = wg_tid; idx < 64 * kChunks; idx += 128) {
      const int r = idx / kChunks, chunk = idx % kChunks;
      const int q = q_begin + rows.token(r);
      if (q >= si.seqlen_q) continue;
      const char* src = stage + staged_offset(r, chunk * 16);
      Out* dst = static_cast<Out*>(a.out) + shift + a.out_offset(b, si, q, h + rows.head(r)) + pass * kCols +
                 chunk * kPerChunk;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    }
    barrier_sync(barrier_id, 128);  // the buffer is free again (next pass, or back to the producer)
  }
}

// The rows of a decode tile that has tokens past the sequence end (one query of each packed head
// per 16-row tile in a decode step), stored from the registers: a quad of threads writes 8
// adjacent columns of a row per pair. Staging would write all 64 rows to shared memory and pass
// four warpgroup barriers (two column halves of a 4-byte split partial) to store a few rows: 2.7
// us of a B = 1 step's 26 on the H200 (bench/gpu/decode_timeline.py).
template <class Out, bool kPacked, class TO, class TC>
__device__ __forceinline__ void store_rows_direct(const TO& o, const TC& c, const AttentionParams& a,
                                                  const route::SeqInfo& si, int b, int h, int q_begin,
                                                  TileRows<kPacked> rows, std::int64_t shift) {
  CUTE_UNROLL
  for (int i = 0; i < size<0>(o); ++i) {
    const int r = get<0>(c(i, 0)), q = q_begin + rows.token(r);
    if (q >= si.seqlen_q) continue;
    Out* dst = static_cast<Out*>(a.out) + shift + a.out_offset(b, si, q, h + rows.head(r));
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o); j += 2) store_pair<Out>(dst + get<1>(c(i, j)), o(i, j), o(i, j + 1));
  }
}

// Normalised O (rowcol view `o`, coordinates `c` in the 64 x D tile) and LSE of one warpgroup,
// staged in `stage` (kOwnBuffer: a buffer only this warpgroup's epilogue uses).
template <int kHeadDim, bool kOwnBuffer, bool kPacked, class TO, class TC, int kRows>
__device__ __forceinline__ void store_output(const TO& o, const TC& c, const TC& c0, const float (&lse)[kRows],
                                             char* stage,
                                             const AttentionParams& a, const CUtensorMap* o_map,
                                             const route::SeqInfo& si, int b, int h, int q_begin,
                                             TileRows<kPacked> rows, const OutputShift& shift, int wg_tid,
                                             int barrier_id) {
  if (a.lse && (threadIdx.x % 4) == 0) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int r = get<0>(c(i, 0)), q = q_begin + rows.token(r);
      if (q < si.seqlen_q) a.lse[shift.lse + a.lse_offset(b, si, q, h + rows.head(r))] = lse[i];
    }
  }
  if constexpr (kPacked) {
    if (q_begin + rows.tokens() > si.seqlen_q) {  // the same for the whole warpgroup
      switch (a.out_type) {
        case ElementType::f32: store_rows_direct<float>(o, c, a, si, b, h, q_begin, rows, shift.out); break;
        case ElementType::f16: store_rows_direct<__half>(o, c, a, si, b, h, q_begin, rows, shift.out); break;
        case ElementType::bf16: store_rows_direct<__nv_bfloat16>(o, c, a, si, b, h, q_begin, rows, shift.out); break;
      }
      return;
    }
  }
  switch (a.out_type) {
    case ElementType::f32:
      store_tile<float, kHeadDim, kOwnBuffer>(o, c, c0, stage, a, nullptr, si, b, h, q_begin, rows, shift.out, wg_tid,
                                              barrier_id);
      break;
    case ElementType::f16:
      store_tile<__half, kHeadDim, kOwnBuffer>(o, c, c0, stage, a, o_map, si, b, h, q_begin, rows, shift.out, wg_tid,
                                               barrier_id);
      break;
    case ElementType::bf16:
      store_tile<__nv_bfloat16, kHeadDim, kOwnBuffer>(o, c, c0, stage, a, o_map, si, b, h, q_begin, rows, shift.out,
                                                      wg_tid, barrier_id);
      break;
  }
}

}  // namespace bsattn::gpu::fwd
