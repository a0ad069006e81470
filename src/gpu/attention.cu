#include "gpu/attention.hpp"

namespace bsattn::gpu {
namespace fwd {
#define BSATTN_DECLARE_FAMILY(NAME) \
  cudaError_t run_##NAME(const AttentionParams* a, int tile_m, int block_n, const TokenExtents& extents, \
                         const int* overflow, cudaStream_t s, const DecodeShape* decode);
BSATTN_DECLARE_FAMILY(bf16_d64)
BSATTN_DECLARE_FAMILY(bf16_d128)
BSATTN_DECLARE_FAMILY(bf16_d256)
BSATTN_DECLARE_FAMILY(f16_d64)
BSATTN_DECLARE_FAMILY(f16_d128)
BSATTN_DECLARE_FAMILY(f16_d256)
BSATTN_DECLARE_FAMILY(proxy_bf16_d128)
BSATTN_DECLARE_FAMILY(proxy_f16_d128)
#undef BSATTN_DECLARE_FAMILY
}  // namespace fwd

namespace {

using Family = cudaError_t (*)(const AttentionParams*, int, int, const TokenExtents&, const int*, cudaStream_t,
                               const DecodeShape*);

// The compiled proxy family (SPEC §6) for (dtype, head dim): f16 and bf16 at D = 128 so far.
Family proxy_family(ElementType t, int d) {
#ifdef BSATTN_FWD_PROXY_BF16_D128
  if (t == ElementType::bf16 && d == 128) return &fwd::run_proxy_bf16_d128;
#endif
#ifdef BSATTN_FWD_PROXY_F16_D128
  if (t == ElementType::f16 && d == 128) return &fwd::run_proxy_f16_d128;
#endif
  (void)t;
  (void)d;
  return nullptr;
}

// The compiled family for (dtype, head dim, proxy compensation); null when the build left it out.
Family family(ElementType t, int d, bool proxy) {
  if (proxy) return proxy_family(t, d);
#define BSATTN_FAMILY(DT, TYPE, D)                                         \
  if (t == ElementType::TYPE && d == D) return BSATTN_FAMILY_PTR_##DT##_##D;
#ifdef BSATTN_FWD_BF16_D64
#define BSATTN_FAMILY_PTR_bf16_64 &fwd::run_bf16_d64
#else
#define BSATTN_FAMILY_PTR_bf16_64 nullptr
#endif
#ifdef BSATTN_FWD_BF16_D128
#define BSATTN_FAMILY_PTR_bf16_128 &fwd::run_bf16_d128
#else
#define BSATTN_FAMILY_PTR_bf16_128 nullptr
#endif
#ifdef BSATTN_FWD_BF16_D256
#define BSATTN_FAMILY_PTR_bf16_256 &fwd::run_bf16_d256
#else
#define BSATTN_FAMILY_PTR_bf16_256 nullptr
#endif
#ifdef BSATTN_FWD_F16_D64
#define BSATTN_FAMILY_PTR_f16_64 &fwd::run_f16_d64
#else
#define BSATTN_FAMILY_PTR_f16_64 nullptr
#endif
#ifdef BSATTN_FWD_F16_D128
#define BSATTN_FAMILY_PTR_f16_128 &fwd::run_f16_d128
#else
#define BSATTN_FAMILY_PTR_f16_128 nullptr
#endif
#ifdef BSATTN_FWD_F16_D256
#define BSATTN_FAMILY_PTR_f16_256 &fwd::run_f16_d256
#else
#define BSATTN_FAMILY_PTR_f16_256 nullptr
#endif
  BSATTN_FAMILY(bf16, bf16, 64)
  BSATTN_FAMILY(bf16, bf16, 128)
  BSATTN_FAMILY(bf16, bf16, 256)
  BSATTN_FAMILY(f16, f16, 64)
  BSATTN_FAMILY(f16, f16, 128)
  BSATTN_FAMILY(f16, f16, 256)
#undef BSATTN_FAMILY
  return nullptr;
}

}  // namespace

int forward_kernel_block_n(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy, bool decode) {
  if (!family(dtype, head_dim, proxy) || (decode && proxy)) return 0;
  if (decode ? tile_m != 16 && tile_m != 32 && tile_m != 64 : tile_m != 64 && tile_m != 128) return 0;
  if (tile_n <= 0 || tile_n % 16 != 0) return 0;
  if (tile_n <= 64) return 64;
  if (head_dim <= 128 && tile_n <= 128) return 128;
  return 0;
}

cudaError_t configure_forward(ElementType dtype, int head_dim, int tile_m, int tile_n, bool proxy, bool decode) {
  const Family f = family(dtype, head_dim, proxy);
  const int block_n = forward_kernel_block_n(dtype, head_dim, tile_m, tile_n, proxy, decode);
  if (!f || block_n == 0) return cudaErrorInvalidValue;
  const DecodeShape shape;
  return f(nullptr, tile_m, block_n, TokenExtents{}, nullptr, nullptr, decode ? &shape : nullptr);
}

cudaError_t run_forward(const AttentionParams& a, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream, const DecodeShape* decode) {
  const bool proxy = a.route.proxy_mode != 0;
  const Family f = family(a.in_type, a.head_dim, proxy);
  const int block_n =
      forward_kernel_block_n(a.in_type, a.head_dim, a.route.tile_m, a.route.tile_n, proxy, decode != nullptr);
  if (!f || block_n == 0) return cudaErrorInvalidValue;
  return f(&a, a.route.tile_m, block_n, extents, overflow, stream, decode);
}

}  // namespace bsattn::gpu
