// Backward kernels for f16, head dim 256 (KV tile widths: 64).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(f16_d256, cute::half_t, 256, 64)
