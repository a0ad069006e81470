// Host-side CUDA helpers of the API layer: an error check that throws bsattn::Error, and a scope
// that makes the problem's device current (launches and allocations go to the current device).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "bsattn/tensor.hpp"

namespace bsattn::gpu {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("cuda", std::string(what) + ": " + cudaGetErrorString(e));
}

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace bsattn::gpu
