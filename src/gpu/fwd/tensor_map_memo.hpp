// cuTensorMapEncodeTiled behind a per-thread memo (host only). A plan that runs again on the same
// tensors (the same base addresses, sizes and strides: a training or serving loop, a benchmark)
// copies its 128-byte Q, K, V and O maps from the memo instead of encoding them again, which is
// host time on every run() (issue 14.3). An encode is a pure function of its arguments and needs
// no context, so a hit gives exactly the map the driver would; any changed address or stride misses
// and encodes.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace bsattn::gpu::fwd {

// The signature of cuTensorMapEncodeTiled.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's encoder, looked up once (null where the driver has none).
inline EncodeTiled driver_encode_tiled() {
  static const EncodeTiled encode = []() -> EncodeTiled {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not sticky: leave no stale error for the caller's next check
      return nullptr;
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encode;
}

// The driver's encoder with the memo in front: the latest kSlots successful encodes of this thread
// (a plan encodes four maps per run; several plans alternating share the slots round robin).
inline CUresult encode_tiled_memo(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* base,
                                  const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                  const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                  CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                  CUtensorMapFloatOOBfill oob) {
  constexpr int kMaxRank = 5, kSlots = 16;
  // Every argument as one word (unused dimensions zero), compared whole.
  constexpr int kWords = 7 + 4 * kMaxRank;
  const EncodeTiled encode = driver_encode_tiled();
  if (!encode) return CUDA_ERROR_NOT_FOUND;
  if (rank < 1 || rank > kMaxRank) return encode(map, type, rank, base, dims, strides, box, element_strides,
                                                 interleave, swizzle, l2, oob);
  std::uint64_t key[kWords] = {static_cast<std::uint64_t>(type),       rank,
                               reinterpret_cast<std::uintptr_t>(base), static_cast<std::uint64_t>(interleave),
                               static_cast<std::uint64_t>(swizzle),    static_cast<std::uint64_t>(l2),
                               static_cast<std::uint64_t>(oob)};
  for (cuuint32_t i = 0; i < rank; ++i) {
    key[7 + i] = dims[i];
    key[7 + kMaxRank + i] = i + 1 < rank ? strides[i] : 0;  // rank - 1 strides
    key[7 + 2 * kMaxRank + i] = box[i];
    key[7 + 3 * kMaxRank + i] = element_strides[i];
  }
  struct Slot {
    std::uint64_t key[kWords];
    CUtensorMap map;
    bool used;
  };
  thread_local Slot slots[kSlots] = {};
  thread_local int next = 0;
  for (const Slot& s : slots)
    if (s.used && std::memcmp(s.key, key, sizeof key) == 0) {
      *map = s.map;
      return CUDA_SUCCESS;
    }
  const CUresult r = encode(map, type, rank, base, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
  if (r == CUDA_SUCCESS) {
    Slot& s = slots[next];
    next = (next + 1) % kSlots;
    std::memcpy(s.key, key, sizeof key);
    s.map = *map;
    s.used = true;
  }
  return r;
}

// What encode_maps calls: the memoised encoder, or null where the driver has none.
inline EncodeTiled tensor_map_encoder() { return driver_encode_tiled() ? &encode_tiled_memo : nullptr; }

}  // namespace bsattn::gpu::fwd
