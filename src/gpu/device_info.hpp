// Device properties that launches and plans need often, queried once per device.
#pragma once
#include <cuda_runtime.h>

#include <atomic>

namespace bsattn::gpu {

constexpr int kMaxDevices = 64;  // devices whose answers are kept (others query at each call)

// Multiprocessors of `device`, queried once per device (every launch needs it; issue 14.3); 0 if
// the query failed (its error is left for the caller's cudaGetLastError).
inline int multiprocessors(int device) {
  static std::atomic<int> known[kMaxDevices] = {};
  if (device < kMaxDevices && known[device].load(std::memory_order_relaxed) > 0)
    return known[device].load(std::memory_order_relaxed);
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device < kMaxDevices) known[device].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace bsattn::gpu
