// Backward kernels for bf16, head dim 128 (KV tile widths: 64, 128).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(bf16_d128, cute::bfloat16_t, 128, 64, 128)
