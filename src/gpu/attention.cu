#include "gpu/attention.hpp"

#include "gpu/fwd/kernel_set.hpp"
#include "gpu/fwd/scheduler.cuh"

namespace bsattn::gpu {
namespace {

using fwd::KernelKind;
using Kernels = cudaError_t (*)(const AttentionParams*, const TokenExtents&, const int*, cudaStream_t,
                                const DecodeShape*);

// One compiled (dtype, head dim, width, proxy, kind): its launcher and its kernel's CTAs per
// multiprocessor (rows64: for tiles of one query head).
struct KernelSet {
  Kernels run = nullptr;
  int (*ctas_per_sm)() = nullptr;
  explicit operator bool() const { return run != nullptr; }
};

// The kernels of (width, kind) among those src/gpu/CMakeLists.txt generates for a compiled
// (dtype, head dim): widths 64 and 128 (D <= 128) or 64; no decode kind with proxy compensation.
template <ElementType kType, int kHeadDim, bool kProxy>
KernelSet kernels_of(int block_n, KernelKind kind) {
  const auto of_width = [&](auto width) -> KernelSet {
    constexpr int kN = decltype(width)::value;
    const auto set = [](auto of_kind) -> KernelSet {
      constexpr KernelKind kKind = decltype(of_kind)::value;
      return {&fwd::run_kernels<kType, kHeadDim, kN, kProxy, kKind>,
              &fwd::kernel_ctas_per_sm<kType, kHeadDim, kN, kProxy, kKind>};
    };
    switch (kind) {
      case KernelKind::decode:
        if constexpr (kProxy) return {};
        else return set(std::integral_constant<KernelKind, KernelKind::decode>{});
      case KernelKind::rows64: return set(std::integral_constant<KernelKind, KernelKind::rows64>{});
      case KernelKind::rows128: return set(std::integral_constant<KernelKind, KernelKind::rows128>{});
    }
    return {};
  };
  if (block_n == 64) return of_width(std::integral_constant<int, 64>{});
  if constexpr (kHeadDim <= 128) {
    if (block_n == 128) return of_width(std::integral_constant<int, 128>{});
  }
  return {};
}

// The kernels of (dtype, head dim, proxy policy) if the build compiled that (dtype, head dim):
// BSATTN_FWD_<DT>_D<D> (src/gpu/CMakeLists.txt, which compiles both proxy policies of each).
// `block_n` 0: any width (a family check).
KernelSet compiled_kernels(ElementType t, int d, bool proxy, int block_n, KernelKind kind) {
  if (block_n == 0) block_n = 64;
#define BSATTN_COMPILED_FAMILY(TYPE, D)                                                                      \
  if (t == ElementType::TYPE && d == D)                                                                      \
    return proxy ? kernels_of<ElementType::TYPE, D, true>(block_n, kind)                                     \
                 : kernels_of<ElementType::TYPE, D, false>(block_n, kind);
#ifdef BSATTN_FWD_BF16_D64
  BSATTN_COMPILED_FAMILY(bf16, 64)
#endif
#ifdef BSATTN_FWD_BF16_D128
  BSATTN_COMPILED_FAMILY(bf16, 128)
#endif
#ifdef BSATTN_FWD_BF16_D256
  BSATTN_COMPILED_FAMILY(bf16, 256)
#endif
#ifdef BSATTN_FWD_F16_D64
  BSATTN_COMPILED_FAMILY(f16, 64)
#endif
#ifdef BSATTN_FWD_F16_D128
  BSATTN_COMPILED_FAMILY(f16, 128)
#endif
#ifdef BSATTN_FWD_F16_D256
  BSATTN_COMPILED_FAMILY(f16, 256)
#endif
#undef BSATTN_COMPILED_FAMILY
  (void)t;
  (void)d;
  (void)proxy;
  (void)block_n;
  (void)kind;
  return {};
}

// 64 where tile_n is 128 and the kind's 64-wide kernel fits more CTAs per multiprocessor than its
// 128-wide one, else tile_n.
int narrower_if_more_resident(ElementType dtype, int head_dim, int tile_n, KernelKind kind) {
  if (tile_n != 128 || head_dim > 128) return tile_n;
  const KernelSet wide = compiled_kernels(dtype, head_dim, false, 128, kind);
  const KernelSet narrow = compiled_kernels(dtype, head_dim, false, 64, kind);
  return wide && narrow && narrow.ctas_per_sm() > wide.ctas_per_sm() ? 64 : tile_n;
}

KernelKind kind_of(int tile_m, bool decode) {
  return decode ? KernelKind::decode : tile_m == 128 ? KernelKind::rows128 : KernelKind::rows64;
}

}  // namespace

int forward_kernel_block_n(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy, bool decode) {
  if (!compiled_kernels(dtype, head_dim, proxy, 0, KernelKind::rows64) || (decode && proxy)) return 0;
  if (decode ? tile_m != 16 && tile_m != 32 && tile_m != 64 : tile_m != 64 && tile_m != 128) return 0;
  if (tile_n <= 0 || tile_n % 16 != 0) return 0;
  if (tile_n <= 64) return 64;
  if (head_dim <= 128 && tile_n <= 128) return 128;
  return 0;
}

int prefill_route_tile_n(ElementType dtype, int head_dim, const route::RouteParams& geometry) {
  const int tile_n = geometry.tile_n;
  if (geometry.tile_m != 64 || fwd::packable_heads(geometry)) return tile_n;
  return narrower_if_more_resident(dtype, head_dim, tile_n, KernelKind::rows64);
}

int decode_route_tile_n(ElementType dtype, int head_dim, int tile_n) {
  return narrower_if_more_resident(dtype, head_dim, tile_n, KernelKind::decode);
}

cudaError_t configure_forward(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy, bool decode) {
  const int block_n = forward_kernel_block_n(dtype, head_dim, tile_m, tile_n, proxy, decode);
  const Kernels k = block_n ? compiled_kernels(dtype, head_dim, proxy, block_n, kind_of(tile_m, decode)).run : nullptr;
  if (!k) return cudaErrorInvalidValue;
  const DecodeShape shape;
  return k(nullptr, TokenExtents{}, nullptr, nullptr, decode ? &shape : nullptr);
}

cudaError_t run_forward(const AttentionParams& a, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream, const DecodeShape* decode) {
  const bool proxy = a.route.proxy_mode != 0;
  const int block_n =
      forward_kernel_block_n(a.in_type, a.head_dim, a.route.tile_m, a.route.tile_n, proxy, decode != nullptr);
  const Kernels k =
      block_n ? compiled_kernels(a.in_type, a.head_dim, proxy, block_n, kind_of(a.route.tile_m, decode != nullptr)).run
              : nullptr;
  if (!k) return cudaErrorInvalidValue;
  return k(&a, extents, overflow, stream, decode);
}

}  // namespace bsattn::gpu
