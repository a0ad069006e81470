// src/gpu/merge_states.cu compiled by the host compiler on cuda_emulation.hpp: defines
// bsattn::gpu::merge_states, which runs the kernel's blocks one by one on the host.
#include "cuda_emulation.hpp"

#include <cuda_bf16.h>

#define cudaGetLastError() cudaSuccess

#include "../../../src/gpu/merge_states.cu"
