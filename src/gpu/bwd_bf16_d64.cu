// Backward kernels for bf16, head dim 64 (KV tile widths: 64, 128).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(bf16_d64, cute::bfloat16_t, 64, 64, 128)
