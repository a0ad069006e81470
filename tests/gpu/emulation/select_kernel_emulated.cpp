// src/gpu/select_blocks.cu compiled by the host compiler on cuda_emulation.hpp: defines
// bsattn::gpu::select_blocks, which runs the kernel's blocks one by one on the host.
#include "cuda_emulation.hpp"

#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaGetLastError() cudaSuccess

namespace bsattn::gpu {
namespace {
alignas(16) unsigned char shared_raw[232448];  // the H200's opt-in limit per block
const bool registered = (cuda_emulation::shared_array() = {shared_raw, sizeof shared_raw}, true);
}  // namespace
}  // namespace bsattn::gpu

#include "../../../src/gpu/select_blocks.cu"
