// Tile configuration of the SM90 forward kernel: element type, head dim, consumer warpgroups
// (64 query rows each), KV tile width, shared-memory layouts and the two warpgroup MMAs.
#pragma once
#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

// kHeadsPerTile 2 (GQA packing, two consumer warpgroups): each warpgroup takes the same 64
// query rows of a different query head of one KV group, so both share every K/V tile load.
// kPairMulticast (128-row tiles): a cluster of two CTAs takes a query-head pair of one KV group
// on the same route row; each CTA's producer loads half of every K/V tile and multicasts it to
// both, halving the L2 traffic per FLOP.
// kDecode (decode.cuh): one warpgroup whose 64 rows are the query heads of one KV group times
// 64 / heads tokens, and work items that split a route row's KV routes (split-KV).
// kCtasPerSm 2 (one consumer warpgroup, shared memory for two): two CTAs per multiprocessor, so
// that one CTA's softmax runs under the other's GEMMs as two consumer warpgroups of one CTA do
// (persistent prefill), or so that a decode step's cluster of splits fits on half as many SMs.
// kRoutesPerStep 2 (route pairs): a pipeline step holds two routes of at most kBlockN / 2 tokens
// side by side, any two KV tiles of the row (two boxes per operand and stage), so that routes of 64
// run as 128-wide steps: one softmax pass, one rescale of O and one stage handoff per 128 columns.
template <class Element_, int kHeadDim_, int kWarpgroups_, int kBlockN_, int kHeadsPerTile_ = 1, int kStages_ = 2,
          bool kPairMulticast_ = false, bool kDecode_ = false, int kCtasPerSm_ = 1, int kRoutesPerStep_ = 1>
struct Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kHeadsPerTile = kHeadsPerTile_;
  static constexpr bool kPairMulticast = kPairMulticast_;
  static constexpr bool kDecode = kDecode_;
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static_assert(kCtasPerSm == 1 || (kWarpgroups == 1 && !kPairMulticast), "two CTAs per SM: one consumer warpgroup");
  static_assert(!kDecode || (kWarpgroups == 1 && kHeadsPerTile == 1 && !kPairMulticast), "decode: one warpgroup");
  static constexpr int kItemHeads = kPairMulticast ? 2 : kHeadsPerTile;  // query heads per work item
  static constexpr int kBlockM = 64 * kWarpgroups / kHeadsPerTile;  // query rows of the route tile
  static_assert(kHeadsPerTile == 1 || kHeadsPerTile == kWarpgroups, "packing: one head per warpgroup");
  static constexpr int kBlockN = kBlockN_;          // KV tokens per pipeline step
  static constexpr int kRoutesPerStep = kRoutesPerStep_;
  static constexpr int kRouteN = kBlockN / kRoutesPerStep;  // KV tokens per route (the route's tile_n <= kRouteN)
  static_assert(kRoutesPerStep == 1 || (kRoutesPerStep == 2 && kBlockN == 128 && !kPairMulticast && !kDecode),
                "route pairs: 128-wide steps of a single-CTA prefill kernel");
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * kWarpgroups;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "tile shape");

  // Q: one 64 x D tile per warpgroup; K: N x D; V is stored as V^T (D x N, D contiguous), the
  // MN-major B operand of the PV GEMM. 128-byte swizzles, as the wgmma descriptors expect.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T atoms are ordered along N first: each 64-wide D slice is one contiguous
  // kBlockN x 128-byte block, which is what one bulk tensor copy box (64 x kBlockN) writes.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                              Step<_2, _1, _3>{}));

  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>()));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) Element q[kWarpgroups][64 * kHeadDim];
    alignas(1024) Element k[kStages * kBlockN * kHeadDim];
    alignas(1024) Element v[kStages * kBlockN * kHeadDim];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + base alignment
};

}  // namespace bsattn::gpu::fwd
