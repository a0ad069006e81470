// Block selection on the GPU (SPEC §7): the kernel behind select_blocks() for Device::cuda. Its
// row arithmetic is route/selection.hpp's, so its bitmask equals the CPU engine's bit for bit.
#pragma once
#include <cuda_runtime.h>

#include "bsattn/route/selection.hpp"

namespace bsattn::gpu {

// A row's sort keys live in shared memory, rounded up to a power of two: 8 bytes each.
constexpr int kSelectMaxKvBlocks = 16384;

// Launches on `stream` on the current device; no host sync, no allocation. Needs
// params.max_kv_blocks <= kSelectMaxKvBlocks.
cudaError_t select_blocks(const route::SelectParams& params, cudaStream_t stream);

}  // namespace bsattn::gpu
