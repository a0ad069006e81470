// Backward kernels for bf16, head dim 256 (KV tile widths: 64).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(bf16_d256, cute::bfloat16_t, 256, 64)
