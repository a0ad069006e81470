// Tensor views: what the library reads and writes, without owning it.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace bsattn {

enum class DType : std::uint8_t { f32, f16, bf16, i32, u32 };
enum class Device : std::uint8_t { cpu, cuda };

const char* to_string(DType dtype);
const char* to_string(Device device);
std::size_t element_size(DType dtype);

// A non-owning strided view. Strides are in elements. Rank at most 5.
struct TensorView {
  static constexpr int kMaxRank = 5;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  // Row-major contiguous view of `shape`.
  static TensorView contiguous(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu, int device_index = 0);
  // Explicit strides (elements); the last one must be 1 for Q/K/V/O.
  static TensorView strided(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> stride, Device device = Device::cpu,
                            int device_index = 0);

  // A tensor is given when its pointer is not null. A view of zero elements is given too (an empty
  // BSR set, an empty batch): contiguous() and strided() point one whose producer handed over a
  // null pointer (an empty std::vector's data(), a zero-size DLPack tensor) at empty_address(),
  // which nothing reads.
  bool defined() const { return data != nullptr; }
  static void* empty_address();
  std::int64_t numel() const;
  std::string shape_string() const;  // "[2, 128, 8, 64]"
};

// Every failure the library reports. `argument()` names the offending argument.
class Error : public std::invalid_argument {
 public:
  Error(std::string argument, const std::string& message)
      : std::invalid_argument("bsattn: " + argument + ": " + message), argument_(std::move(argument)) {}
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

}  // namespace bsattn
