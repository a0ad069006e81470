// One (dtype, head dim) family of forward kernels: tile_m 128 (two consumer warpgroups), 64 (one)
// and 64 with two packed query heads, by the compiled KV tile widths. Each family is one
// translation unit.
#pragma once
#include "gpu/fwd/launch.cuh"

namespace bsattn::gpu::fwd {

// Where the head grouping allows it, tile_m 64 runs two query heads per CTA (GQA packing) and
// tile_m 128 with 128-wide K/V tiles a CTA pair sharing its K/V loads (pair multicast). With `a`
// null (plan time) every kernel the shape may take is configured. kProxy: the kernels with proxy
// compensation (proxy.cuh); they have no CTA pair (its K/V halves are multicast by TMA, the
// summary gather is a cp.async copy into one CTA). `decode` non-null: the decode kernel
// (decode.cuh), exact routes only.
template <class Element, int kHeadDim, int kBlockN, bool kProxy>
cudaError_t run_family_n(const AttentionParams* a, int tile_m, const TokenExtents& extents, const int* overflow,
                         cudaStream_t stream, const DecodeShape* decode) {
  if constexpr (!kProxy) {
    // Three stages where they fit (D <= 128): one warpgroup streams K/V at memory speed and wants
    // more bytes in flight than the prefill tiles.
    using Decode = Traits<Element, kHeadDim, 1, kBlockN, 1, kHeadDim <= 128 ? 3 : 2, false, true>;
    if (decode) return launch_forward_ws<Decode>(a, extents, overflow, stream, decode_geometry(*decode));
  } else if (decode) {
    return cudaErrorInvalidValue;
  }
  using Rows128 = Traits<Element, kHeadDim, 2, kBlockN>;
  using Rows64 = Traits<Element, kHeadDim, 1, kBlockN>;
  using Rows64Packed = Traits<Element, kHeadDim, 2, kBlockN, 2>;
  if constexpr (kBlockN == 128 && !kProxy) {  // 128-wide K/V tiles: halves of 64 tokens per CTA
    // Three stages where they fit (D <= 128: 224 KB): the pair advances in lockstep and needs the
    // slack (measured 0.93-0.98x the single-CTA kernel with two stages, 1.00-1.06x with three;
    // the single-CTA kernel itself lost 4-7 % with three).
    using Rows128Pair = Traits<Element, kHeadDim, 2, kBlockN, 1, kHeadDim <= 128 ? 3 : 2, true>;
    if (tile_m == 128 && !a) {
      const cudaError_t e = launch_forward_ws<Rows128Pair>(nullptr, extents, overflow, stream);
      if (e != cudaSuccess) return e;
    } else if (tile_m == 128 && packable_heads(a->route)) {
      const cudaError_t e = launch_forward_ws<Rows128Pair>(a, extents, overflow, stream);
      if (e != cudaErrorNotSupported) return e;
    }
  }
  if (tile_m == 128) return launch_forward_ws<Rows128, kProxy>(a, extents, overflow, stream);
  if (tile_m != 64) return cudaErrorInvalidValue;
  if (!a) {
    const cudaError_t e = launch_forward_ws<Rows64, kProxy>(nullptr, extents, overflow, stream);
    return e != cudaSuccess ? e : launch_forward_ws<Rows64Packed, kProxy>(nullptr, extents, overflow, stream);
  }
  if (packable_heads(a->route)) return launch_forward_ws<Rows64Packed, kProxy>(a, extents, overflow, stream);
  return launch_forward_ws<Rows64, kProxy>(a, extents, overflow, stream);
}

}  // namespace bsattn::gpu::fwd

// Defines bsattn::gpu::fwd::run_<NAME>(params or null, tile_m, block_n, extents, overflow, stream, decode):
// the exact kernels (BSATTN_FORWARD_FAMILY) or the proxy ones (BSATTN_FORWARD_PROXY_FAMILY, NAME
// proxy_<dtype>_d<D>), a translation unit each.
#define BSATTN_FORWARD_FAMILY_OF(NAME, PROXY, ELEMENT, HEAD_DIM, ...)                                      \
  namespace bsattn::gpu::fwd {                                                                             \
  cudaError_t run_##NAME(const AttentionParams* a, int tile_m, int block_n, const TokenExtents& extents,   \
                         const int* overflow, cudaStream_t s, const DecodeShape* decode) {                 \
    return dispatch_width<ELEMENT, HEAD_DIM, PROXY, __VA_ARGS__>(a, tile_m, block_n, extents, overflow, s, \
                                                                  decode);                                 \
  }                                                                                                        \
  }
#define BSATTN_FORWARD_FAMILY(NAME, ELEMENT, HEAD_DIM, ...) \
  BSATTN_FORWARD_FAMILY_OF(NAME, false, ELEMENT, HEAD_DIM, __VA_ARGS__)
#define BSATTN_FORWARD_PROXY_FAMILY(NAME, ELEMENT, HEAD_DIM, ...) \
  BSATTN_FORWARD_FAMILY_OF(NAME, true, ELEMENT, HEAD_DIM, __VA_ARGS__)

namespace bsattn::gpu::fwd {
template <class Element, int kHeadDim, bool kProxy, int kFirst, int... kRest>
cudaError_t dispatch_width(const AttentionParams* a, int tile_m, int block_n, const TokenExtents& extents,
                           const int* overflow, cudaStream_t s, const DecodeShape* decode) {
  if (block_n == kFirst)
    return run_family_n<Element, kHeadDim, kFirst, kProxy>(a, tile_m, extents, overflow, s, decode);
  if constexpr (sizeof...(kRest) > 0)
    return dispatch_width<Element, kHeadDim, kProxy, kRest...>(a, tile_m, block_n, extents, overflow, s, decode);
  return cudaErrorInvalidValue;
}
}  // namespace bsattn::gpu::fwd
