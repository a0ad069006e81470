// Emulation stand-in for src/gpu/device_guard.hpp: there is no device to select.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "bsattn/tensor.hpp"

namespace bsattn::gpu {
inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("cuda", std::string(what) + ": error " + std::to_string(static_cast<int>(e)));
}
struct DeviceGuard {
  explicit DeviceGuard(int) {}
};
}  // namespace bsattn::gpu
