// Forward kernels for f16, head dim 256 (KV tile widths: 64).
#include "gpu/fwd/instantiate.cuh"

BSATTN_FORWARD_FAMILY(f16_d256, cute::half_t, 256, 64)
