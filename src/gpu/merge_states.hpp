// The merge of partial attention results (bsattn/merge.hpp) on the GPU.
#pragma once
#include <cuda_runtime.h>

#include "api/merge_params.hpp"

namespace bsattn::gpu {

// Launches one kernel on `stream` for params (device pointers, validated): no host
// synchronisation, no allocation.
cudaError_t merge_states(const merge::MergeParams& params, cudaStream_t stream);

}  // namespace bsattn::gpu
