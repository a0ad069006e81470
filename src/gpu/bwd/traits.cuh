// Tile configuration of the SM90 backward kernel: one CTA holds a KV tile (kBlockN tokens of K
// and V, resident) and walks the Q tiles that attend it in steps of 64 query rows. Two
// warpgroups. The five GEMMs:
//   S  = Q K^T, dP = dO V^T   64 x kBlockN x D, the warpgroups split the KV columns
//   dV += P^T dO              kBlockN x D x 64, warpgroup 0
//   dK += dS^T Q              kBlockN x D x 64, warpgroup 1
//   dQ  = dS K                64 x D x kBlockN, the warpgroups split D (D >= 128) or warpgroup 1
// Every operand is read from shared memory with 128-byte swizzles; the transposed operands are
// views of the same bytes (a K-major tile read as the MN-major operand), so P and dS are written
// once and Q, dO are loaded once per step.
#pragma once
#include <cute/atom/copy_traits_sm90.hpp>

#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::bwd {

using namespace cute;
using fwd::cp_async_16;
using fwd::cp_async_4;
using fwd::cp_async_commit;
using fwd::wg_gemm;

template <class Element_, int kHeadDim_, int kBlockN_>
struct Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = 64;  // query rows per step
  static constexpr int kStages = 2;   // Q / dO / LSE / delta double buffer
  static constexpr int kThreads = 256;
  // dQ = dS K: split along D over both warpgroups where each half fills a 64-wide swizzle atom.
  static constexpr int kDqWarpgroups = kHeadDim >= 128 ? 2 : 1;
  static constexpr int kDqWarpgroup0 = 2 - kDqWarpgroups;  // first warpgroup that computes dQ
  // dQ's GEMM issued before dK / dV's, its adds under theirs (both warpgroups compute dQ). Not at
  // D 256: its 64 dQ accumulators per thread live beside dK / dV's 128 there spilled 4 bytes.
  static constexpr bool kDqFirst = kDqWarpgroups == 2 && kHeadDim <= 128;
  static_assert(kHeadDim % 64 == 0 && (kBlockN == 64 || kBlockN == 128), "tile shape");
  // Registers: dK or dV of a warpgroup is kBlockN x D / 128 floats per thread.
  static_assert(kBlockN * kHeadDim <= 128 * 128, "dK / dV accumulators would not fit in registers");

  using Atom = GMMA::Layout_K_SW128_Atom<Element>;
  // Q and dO: 64 x D per stage, D contiguous. Their transposes (D x 64) are the MN-major B operands
  // of dK and dV.
  using SmemLayoutQ = decltype(tile_to_shape(Atom{}, Shape<_64, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, _64, Int<kStages>>{}, Stride<_64, _1, Int<64 * kHeadDim>>{})));
  // K and V: kBlockN x D. K^T (D x kBlockN) is the MN-major B operand of dQ.
  using SmemLayoutK = decltype(tile_to_shape(Atom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // P and dS: 64 x kBlockN, KV contiguous (the K-major A operand of dQ); their transposes are the
  // MN-major A operands of dV and dK.
  using SmemLayoutP = decltype(tile_to_shape(Atom{}, Shape<_64, Int<kBlockN>>{}));
  using SmemLayoutPt =
      decltype(composition(SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, _64>{}, Stride<_64, _1>{})));

  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN / 2>, Int<kHeadDim>>>(),
      Layout<Shape<_1, _2, _1>>{}));
  using MmaDKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, _64>, GMMA::Major::MN,
                           GMMA::Major::MN>()));
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / kDqWarpgroups>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kDqWarpgroups>, _1>>{}));

  struct SharedStorage {
    alignas(1024) Element k[kBlockN * kHeadDim];
    alignas(1024) Element v[kBlockN * kHeadDim];
    alignas(1024) Element q[kStages * 64 * kHeadDim];
    alignas(1024) Element dout[kStages * 64 * kHeadDim];
    alignas(1024) Element p[64 * kBlockN];
    alignas(1024) Element ds[64 * kBlockN];
    float lse_log2[kStages][64];
    float delta[kStages][64];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + base alignment
};

}  // namespace bsattn::gpu::bwd
