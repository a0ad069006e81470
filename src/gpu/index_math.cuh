// Integer helpers for the index arithmetic of streaming kernels (merge_states): their work items
// are numbered by 64-bit indices, and a 64-bit division is a long routine (tens of instructions)
// where 32 bits take a few.
#pragma once
#include <cstdint>

namespace bsattn::gpu {

// n / d and n % d (n >= 0, d > 0), in 32-bit arithmetic when both fit.
__device__ __forceinline__ void divmod(std::int64_t n, std::int64_t d, std::int64_t& q, std::int64_t& r) {
  if (((n | d) >> 32) == 0) {
    const auto a = static_cast<std::uint32_t>(n), b = static_cast<std::uint32_t>(d);
    q = a / b;
    r = a - static_cast<std::uint32_t>(q) * b;
  } else {
    q = n / d;
    r = n - q * d;
  }
}

}  // namespace bsattn::gpu
