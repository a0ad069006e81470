// Backward kernels for f16, head dim 128 (KV tile widths: 64, 128).
#include "gpu/bwd/instantiate.cuh"

BSATTN_BACKWARD_FAMILY(f16_d128, cute::half_t, 128, 64, 128)
