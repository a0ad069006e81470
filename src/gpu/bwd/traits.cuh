// Tile configuration of the SM90 backward kernel: one CTA holds a KV tile (kBlockN tokens of K
// and V, resident) and walks the Q tiles that attend it in steps of kStepRows query rows (64; 128
// at D 64 where route tiles are multiples of 128). A producer warpgroup (the walk and the loads)
// and two consumer warpgroups. The five GEMMs (M = kStepRows):
//   kBlockN 128 (kOwnRows): each consumer owns 64 KV rows and computes its scores transposed,
//       S^T = K Q^T and dP^T = V dO^T as 64 KV rows x M query rows, so that P^T and dS^T, in
//       its registers, are the A operands of dV += P^T dO and dK += dS^T Q (64 x D x M, register
//       A): P never goes to shared memory, and dS goes there once, transposed, for dQ;
//   kBlockN 64: S = Q K^T and dP = dO V^T (64 x 64, the consumers split the KV columns), P and dS
//       to shared memory; consumer 0 computes dV, consumer 1 dK (64 x D x 64), each from both
//       consumers' P or dS;
//   dQ  = dS K                M x D x kBlockN: 128-row steps split the rows over the consumers,
//       64-row steps split D (D >= 128) or leave it to consumer 1;
//   kSolo (kBlockN 64, D <= 128, route Q tiles of 64 rows): each consumer takes every other step
//       alone, with the 128-wide consumers' transposed GEMMs over the whole 64-row tile, and its
//       own dQ (64 x D x 64); the consumers never wait for each other in the walk, and their dK
//       and dV partials are summed once, after it.
// Shared operands use 128-byte swizzles; the transposed operands are views of the same bytes (a
// K-major tile read as the MN-major operand), so Q and dO are loaded once per step.
#pragma once
#include <cute/atom/copy_traits_sm90.hpp>

#include "gpu/bwd/dq_tiles.hpp"
#include "gpu/bwd/steps.cuh"
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::bwd {

// Where a CTA's dK and dV go: the element offsets of its KV tile's first row (column 0) in dk and
// dv, and how many of the tile's rows the sequence owns. Written to shared memory by the prologue
// and read back by the epilogue, so that nothing of it stays in registers across the step loop
// (the consumers' 232 registers are full there).
struct DkvTarget {
  std::int64_t dk, dv;
  int rows;
};

using namespace cute;
using fwd::cp_async_16;
using fwd::cp_async_4;
using fwd::wg_gemm;

// Named barriers (hardware ids; 0 is __syncthreads): both consumers' P and dS of a step (and,
// kSolo, both consumers' partial dK / dV after the walk); the dQ warpgroups' route order
// (deterministic mode); kSolo: each consumer's own dS (kSoloDsBarrier + warpgroup) and route
// order (kSoloOrderBarrier + warpgroup).
constexpr int kStepBarrier = 1, kDqOrderBarrier = 2, kSoloDsBarrier = 3, kSoloOrderBarrier = 5;

// A shared-memory array that may be empty (no bytes, no alignment padding).
template <class E, int N>
struct SmemArray {
  alignas(1024) E data[N];
};
template <class E>
struct SmemArray<E, 0> {};

// Whether the kernel of KV tile width block_n runs a route of Q tiles of tile_m rows with solo
// consumers (Traits::kSolo): 64-wide tiles, whose shared score GEMMs are N = 32 per consumer and
// whose P and dS go through shared memory to the other consumer's dV or dK (356 TFLOP/s at D 128,
// density 0.25, against 515 for 128-wide tiles, bench/RESULTS.md 2026-12-07). Q tiles of 64 rows
// make every column entry one step, so a consumer owns whole entries (the deterministic dQ order
// counts entries).
BSATTN_HD constexpr bool backward_solo_steps(int head_dim, int block_n, int tile_m) {
  return block_n == 64 && head_dim <= 128 && tile_m == 64;
}

template <class Element_, int kHeadDim_, int kBlockN_, int kStepRows_ = 64, bool kSolo_ = false>
struct Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStepRows = kStepRows_;  // query rows per step
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // Registers (setmaxnreg): the producer walks and issues cp.async; the consumers hold dK / dV.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // 40 is all the producer can keep: the consumers' 232 take the rest of the CTA's 384 x 168 (a
  // 48-register producer hung the kernel in setmaxnreg, 2026-12-03).
  static_assert(fwd::register_split_fits(kProducerThreads, kProducerRegs, kConsumerThreads, kConsumerRegs),
                "the consumers' registers exceed the CTA's allocation");
  static constexpr bool kSolo = kSolo_;
  static_assert(!kSolo || backward_solo_steps(kHeadDim, kBlockN, 64), "solo consumers: 64-wide tiles, D <= 128");
  static constexpr bool kOwnRows = kBlockN == 128;
  // Scores transposed (S^T = K Q^T, dP^T = V dO^T: a consumer's KV rows x the step's query rows),
  // P^T and dS^T the register A operands of dV and dK.
  static constexpr bool kTransposed = kOwnRows || kSolo;
  static_assert(kStepRows == 64 || (kStepRows == 128 && kOwnRows && kHeadDim == 64), "step rows");
  // dQ = dS K: 128-row steps split the rows over both consumers (each dQ warpgroup one 64-row tile
  // of the accumulator); 64-row steps split D where each half fills a 64-wide swizzle atom; a solo
  // consumer computes all of it.
  static constexpr bool kDqSplitRows = kStepRows == 128;
  static constexpr int kDqWarpgroups = kSolo ? 1 : kDqSplitRows ? 2 : dq_warpgroups(kHeadDim);
  // Columns of a region of the tiled accumulator (64 rows of the step; dq_tiles.hpp), a dQ GEMM's
  // N. A solo consumer computes its step's kDqSlices regions one after the other (the whole
  // 64 x 128 accumulator beside dK and dV's made ptxas serialise every wgmma, C7512) and its warps
  // add all of them (kDqStagedRegions); else a warpgroup computes and adds its own region.
  static constexpr int kDqColumns = kDqSplitRows ? kHeadDim : kHeadDim / dq_warpgroups(kHeadDim);
  static constexpr int kDqSlices = kSolo ? dq_warpgroups(kHeadDim) : kDqWarpgroups;
  static constexpr int kDqStagedRegions = kSolo ? kDqSlices : 1;
  static constexpr int kDqWarpgroup0 = kSolo ? 0 : 2 - kDqWarpgroups;  // first consumer that computes dQ
  // dQ's GEMM issued before dK / dV's, its adds under theirs (both consumers compute dQ). Not at
  // D 256: its 64 dQ accumulators per thread beside dK / dV's 128 would not fit. Not solo: dQ is
  // staged in the step's Q and dO, which dK and dV read.
  static constexpr bool kDqFirst = kDqWarpgroups == 2 && kHeadDim <= 128;
  static_assert(kHeadDim % 64 == 0 && (kBlockN == 64 || kBlockN == 128), "tile shape");
  // Registers: a consumer's dK and dV (kTransposed) or one of them is 64 x D x (1 or 2) floats / 128.
  static_assert((kTransposed ? 2 : 1) * 64 * kHeadDim <= 128 * 128, "dK / dV accumulators would not fit in registers");
  // P (shared 64-wide tiles): written by both consumers, read by consumer 0's dV; kTransposed keeps
  // P^T in registers. dS: read by both consumers' dQ. Double buffers let a consumer write step
  // i + 1's while the other still reads step i's; the per-step barrier on dS keeps them within one
  // step of each other. Solo: buffer w is consumer w's own.
  static constexpr int kPBuffers = kTransposed ? 0 : 2;
  static constexpr int kDsBuffers = 2;
  // The walk's end is a record per consumer that reads the stages (solo: two, one each).
  static constexpr int kEndRecords = kSolo ? 2 : 1;
  static constexpr int kStageReaderWarps = (kSolo ? 128 : kConsumerThreads) / 32;

  using Atom = GMMA::Layout_K_SW128_Atom<Element>;
  static constexpr int kStepBytes = 2 * kStepRows * kHeadDim * static_cast<int>(sizeof(Element)) +
                                    2 * kStepRows * static_cast<int>(sizeof(float));
  static constexpr int kOperandBytes =
      (2 * kBlockN * kHeadDim + (kPBuffers + kDsBuffers) * kStepRows * kBlockN) * static_cast<int>(sizeof(Element));
  // dQ of a step staged in shared memory (the tiled accumulator's order) and added by one bulk
  // reduction per warp and region, where it fits beside two stages (not at D 256: 64 KB). Solo
  // consumers stage it in the step's own stage, whose Q and dO (bf16 / f16) hold exactly its fp32
  // values once the step's GEMMs have read them; the stage is released when the reduction has read
  // it, under the consumer's next step.
  static constexpr int kDqStageBytes = kStepRows * kHeadDim * static_cast<int>(sizeof(float));
  static_assert(!kSolo || kDqStageBytes == 2 * kStepRows * kHeadDim * static_cast<int>(sizeof(Element)),
                "solo dQ fills its stage's Q and dO");
  static constexpr bool kDqBulk = kSolo || kOperandBytes + kDqStageBytes + 2 * kStepBytes + 2048 <= 227 * 1024;
  static constexpr int kFixedBytes = kOperandBytes + (kDqBulk && !kSolo ? kDqStageBytes : 0);
  // Solo: two stages per consumer (consumer w reads stages w and w + 2: its steps are every other).
  static constexpr int kStages = kSolo ? 4 : kFixedBytes + 3 * kStepBytes + 2048 <= 227 * 1024 ? 3 : 2;
  static_assert(kDqBulk || !kDqSplitRows, "128-row steps stage dQ (add_dq skips rows past the sequence there)");

  // Q and dO: kStepRows x D per stage, D contiguous (64-row blocks kStepRows x 64 apart in each
  // 64 columns: a TMA box each). Their transposes (D x kStepRows) are the MN-major B operands of
  // dK and dV.
  using StepRows = Int<kStepRows>;
  using SmemLayoutQ = decltype(tile_to_shape(Atom{}, Shape<StepRows, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{},
      make_layout(Shape<Int<kHeadDim>, StepRows, Int<kStages>>{}, Stride<StepRows, _1, Int<kStepRows * kHeadDim>>{})));
  // K and V: kBlockN x D. K^T (D x kBlockN) is the MN-major B operand of dQ.
  using SmemLayoutK = decltype(tile_to_shape(Atom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // P and dS: kStepRows x kBlockN, KV contiguous (the K-major A operand of dQ). The atoms tile the
  // rows first, so KV columns [64 h, 64 h + 64) are the contiguous kStepRows x 64 block h; with
  // 64-row steps its transpose is the MN-major A operand (64 KV rows x 64 query rows) of dV and dK
  // (kBlockN 64).
  using SmemLayoutP = decltype(tile_to_shape(Atom{}, Shape<StepRows, Int<kBlockN>>{}));
  // dS^T (kBlockN x kStepRows): where kTransposed consumers store their transposed scores' dS.
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, StepRows>{}, Stride<StepRows, _1>{})));
  using SmemLayoutBlockT = decltype(composition(tile_to_shape(Atom{}, Shape<_64, _64>{}),
                                                make_layout(Shape<_64, _64>{}, Stride<_64, _1>{})));

  // S and dP: kTransposed, KV rows x query rows (kOwnRows: the consumers split the KV rows; solo:
  // one consumer's); else query rows x KV columns, the consumers split the columns.
  using MmaSdP = std::conditional_t<
      kTransposed,
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, StepRows, Int<kHeadDim>>>(),
                              Layout<Shape<Int<kSolo ? 1 : 2>, _1, _1>>{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN / 2>, Int<kHeadDim>>>(),
          Layout<Shape<_1, _2, _1>>{}))>;
  // dV and dK of 64 KV rows: the A operand (P^T, dS^T) from registers (kTransposed) or shared memory.
  using MmaDKV = std::conditional_t<
      kTransposed,
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, StepRows>,
                                                   GMMA::Major::K, GMMA::Major::MN>())),
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, _64>,
                                                   GMMA::Major::MN, GMMA::Major::MN>()))>;
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDqColumns>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      std::conditional_t<kDqSplitRows, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, Int<kDqSlices>, _1>>>{}));

  struct SharedStorage {
    alignas(1024) Element k[kBlockN * kHeadDim];
    alignas(1024) Element v[kBlockN * kHeadDim];
    alignas(1024) Element q[kStages * kStepRows * kHeadDim];
    alignas(1024) Element dout[kStages * kStepRows * kHeadDim];
    alignas(1024) Element ds[kDsBuffers][kStepRows * kBlockN];
    SmemArray<Element, kPBuffers * 64 * kBlockN> p;  // buffer j at data + j * 64 * kBlockN
    SmemArray<float, kDqBulk && !kSolo ? kStepRows * kHeadDim : 0> dq;  // the step's dQ, tiled (dq_tiles.hpp)
    float lse_log2[kStages][kStepRows];
    float delta[kStages][kStepRows];
    Step step[kStages];  // the stage's step, from the producer; head < 0: the walk has ended
    DkvTarget dkv_target;  // the CTA's dK / dV rows, for the epilogue
    alignas(8) std::uint64_t full[kStages], empty[kStages], record[kStages], kv_full;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace bsattn::gpu::bwd
