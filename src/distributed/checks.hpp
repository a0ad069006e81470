// Argument checks of the context-parallel calls (context_parallel.cpp, pattern.cpp).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "bsattn/problem.hpp"

namespace bsattn::distributed {

inline std::string place(Device device, int index) {
  return device == Device::cpu ? "CPU" : "cuda:" + std::to_string(index);
}

// `t` has this shape and dtype and lives with the problem (or, `host_too`, on the host).
inline void expect_shape(const TensorView& t, const char* name, std::initializer_list<std::int64_t> shape, DType dtype,
                         const Problem& local, bool host_too = false) {
  const bool with_problem =
      t.device == local.device && (t.device == Device::cpu || t.device_index == local.device_index);
  bool same = t.rank == static_cast<int>(shape.size()) && t.dtype == dtype &&
              (with_problem || (host_too && t.device == Device::cpu));
  int d = 0;
  for (const std::int64_t n : shape) same = same && t.shape[d++] == n;
  if (!same) {
    std::string want = "[";
    for (const std::int64_t n : shape) want += (want.size() > 1 ? ", " : "") + std::to_string(n);
    throw Error(name, "expected a " + place(local.device, local.device_index) + " " + std::string(to_string(dtype)) +
                          " tensor " + want + "], got " + std::string(to_string(t.dtype)) + " " + t.shape_string() +
                          " on " + place(t.device, t.device_index));
  }
}

}  // namespace bsattn::distributed
