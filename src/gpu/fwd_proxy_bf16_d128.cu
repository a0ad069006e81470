// Forward kernels with proxy compensation (SPEC §6) for bf16, head dim 128 (KV tile widths: 64, 128).
#include "gpu/fwd/instantiate.cuh"

BSATTN_FORWARD_PROXY_FAMILY(proxy_bf16_d128, cute::bfloat16_t, 128, 64, 128)
