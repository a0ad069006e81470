// Backward kernels for f16, head dim 64 (KV tile widths: 64, 128).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(f16_d64, cute::half_t, 64, 64, 128)
