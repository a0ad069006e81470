// One piece of the forward kernels (kernel_set.hpp): the kernels of one kind for (dtype, head dim,
// KV tile width, proxy policy). Included by the generated translation units only.
#pragma once
#include "gpu/fwd/kernel_set.hpp"
#include "gpu/fwd/launch.cuh"

namespace bsattn::gpu::fwd {

template <ElementType>
struct CuteElement;
template <>
struct CuteElement<ElementType::bf16> {
  using type = cute::bfloat16_t;
};
template <>
struct CuteElement<ElementType::f16> {
  using type = cute::half_t;
};

// The tile_m 64 kernel of one query head per tile: two CTAs per multiprocessor where their shared
// memory fits (WsConfig checks the pair).
template <class Element, int kHeadDim, int kBlockN>
using Rows64Traits = Traits<Element, kHeadDim, 1, kBlockN, 1, 2, false, false,
                            Traits<Element, kHeadDim, 1, kBlockN>::kSmemBytes <= 100 * 1024 ? 2 : 1>;

// The decode kernel: one warpgroup streams K/V at memory speed and wants bytes in flight, so three
// stages where they fit (D <= 128). 64-wide tiles instead take two stages and two CTAs per
// multiprocessor (40 / 208 registers): a split step's cluster of up to 16 CTAs then fits on 8
// multiprocessors, so short split steps merge in clusters (api/plan.cpp choose_decode, launch.cuh).
// Route pairs (traits.cuh): two consumer warpgroups, steps of two routes side by side.
template <class Element, int kHeadDim, int kHeadsPerTile>
using RoutePairsTraits = Traits<Element, kHeadDim, 2, 128, kHeadsPerTile, 2, false, false, 1, 2>;

template <class Element, int kHeadDim, int kBlockN>
using DecodeTraits = std::conditional_t<kBlockN == 64 && kHeadDim <= 128,
                                        Traits<Element, kHeadDim, 1, kBlockN, 1, 2, false, true, 2>,
                                        Traits<Element, kHeadDim, 1, kBlockN, 1, kHeadDim <= 128 ? 3 : 2, false, true>>;

template <ElementType kType, int kHeadDim, int kBlockN, bool kProxy, KernelKind kKind>
int kernel_ctas_per_sm() {
  using Element = typename CuteElement<kType>::type;
  if constexpr (kKind == KernelKind::rows64) return Rows64Traits<Element, kHeadDim, kBlockN>::kCtasPerSm;
  else if constexpr (kKind == KernelKind::decode) return DecodeTraits<Element, kHeadDim, kBlockN>::kCtasPerSm;
  else return 1;
}

// Where the head grouping allows it, tile_m 64 runs two query heads per CTA (GQA packing) and
// tile_m 128 with 128-wide K/V tiles a CTA pair sharing its K/V loads (pair multicast). kProxy: the
// kernels with proxy compensation (proxy.cuh), the pair included (a pair's two heads share their
// routes, so their proxy windows too); no decode kernel.
// Measurement switch (environment, read once): BSATTN_GPU_ROUTE_PAIRS=0 runs 64-wide routes one per
// step in 128-row tiles, as before route pairs.
inline bool route_pairs_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("BSATTN_GPU_ROUTE_PAIRS");
    return !(v && v[0] == '0');
  }();
  return enabled;
}

template <ElementType kType, int kHeadDim, int kBlockN, bool kProxy, KernelKind kKind>
cudaError_t run_kernels(const AttentionParams* a, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream, const DecodeShape* decode) {
  using Element = typename CuteElement<kType>::type;
  // Two consumer warpgroups on routes of at most 64 tokens take them in pairs, as 128-wide steps
  // (route pairs, traits.cuh), where the K/V tokens are addressed directly (a paged cache keeps
  // the 64-wide kernels); kHeadsPerTile 1: 128-row tiles, 2: 64-row tiles of two query heads.
  // Proxy kernels too: their windows are then 128 summary rows (proxy.cuh).
  constexpr bool kRoutePairs = kBlockN == 64 && kHeadDim <= 128;
  using Pairs128 = RoutePairsTraits<Element, kHeadDim, 1>;
  using PairsPacked = RoutePairsTraits<Element, kHeadDim, 2>;
  if constexpr (kKind == KernelKind::decode) {
    static_assert(!kProxy, "the decode kernel takes exact routes only");
    return launch_forward_ws<DecodeTraits<Element, kHeadDim, kBlockN>>(a, extents, overflow, stream, decode_geometry(*decode));
  } else if constexpr (kKind == KernelKind::rows128) {
    using Rows128 = Traits<Element, kHeadDim, 2, kBlockN>;
    if constexpr (kBlockN == 128) {  // 128-wide K/V tiles: halves of 64 tokens per CTA
      // Two stages and O's own staging buffer (kernel_config.cuh): the last route's stages go back to
      // the loader when the last PV is done, so the lockstep pair no longer needs a third stage for
      // slack (at or above three stages without the buffer on every row, bench/RESULTS.md 2026-12-06).
      using Rows128Pair = Traits<Element, kHeadDim, 2, kBlockN, 1, 2, true>;
      if (!a) {
        const cudaError_t e = launch_forward_ws<Rows128Pair, kProxy>(nullptr, extents, overflow, stream);
        if (e != cudaSuccess) return e;
      } else if (packable_heads(a->route)) {
        const cudaError_t e = launch_forward_ws<Rows128Pair, kProxy>(a, extents, overflow, stream);
        if (e != cudaErrorNotSupported) return e;
      }
    }
    if constexpr (kRoutePairs) {
      if (!a) {
        const cudaError_t e = launch_forward_ws<Pairs128, kProxy>(nullptr, extents, overflow, stream);
        if (e != cudaSuccess) return e;
      } else if (route_pairs_enabled() && !a->route.paged) {
        return launch_forward_ws<Pairs128, kProxy>(a, extents, overflow, stream);
      }
    }
    return launch_forward_ws<Rows128, kProxy>(a, extents, overflow, stream);
  } else {
    using Rows64 = Rows64Traits<Element, kHeadDim, kBlockN>;
    using Rows64Packed = Traits<Element, kHeadDim, 2, kBlockN, 2>;
    if (!a) {
      cudaError_t e = launch_forward_ws<Rows64, kProxy>(nullptr, extents, overflow, stream);
      if (e == cudaSuccess) e = launch_forward_ws<Rows64Packed, kProxy>(nullptr, extents, overflow, stream);
      if constexpr (kRoutePairs) {
        if (e == cudaSuccess) e = launch_forward_ws<PairsPacked, kProxy>(nullptr, extents, overflow, stream);
      }
      return e;
    }
    if (packable_heads(a->route)) {
      if constexpr (kRoutePairs) {
        if (route_pairs_enabled() && !a->route.paged)
          return launch_forward_ws<PairsPacked, kProxy>(a, extents, overflow, stream);
      }
      return launch_forward_ws<Rows64Packed, kProxy>(a, extents, overflow, stream);
    }
    return launch_forward_ws<Rows64, kProxy>(a, extents, overflow, stream);
  }
}

}  // namespace bsattn::gpu::fwd

// The explicit instantiation a generated translation unit holds.
#define BSATTN_INSTANTIATE_FORWARD(TYPE, HEAD_DIM, BLOCK_N, PROXY, KIND)                                      \
  template cudaError_t bsattn::gpu::fwd::run_kernels<bsattn::ElementType::TYPE, HEAD_DIM, BLOCK_N, PROXY,     \
                                                     bsattn::gpu::fwd::KernelKind::KIND>(                     \
      const bsattn::AttentionParams*, const bsattn::gpu::TokenExtents&, const int*, cudaStream_t,             \
      const bsattn::gpu::DecodeShape*);                                                                        \
  template int bsattn::gpu::fwd::kernel_ctas_per_sm<bsattn::ElementType::TYPE, HEAD_DIM, BLOCK_N, PROXY,      \
                                                    bsattn::gpu::fwd::KernelKind::KIND>();
