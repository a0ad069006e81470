#include "bsattn/problem.hpp"
#include "bsattn/tensor.hpp"

namespace bsattn {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::u32: return "u32";
  }
  return "?";
}

const char* to_string(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

const char* to_string(Format format) {
  switch (format) {
    case Format::all_blocks: return "all_blocks";
    case Format::block_lists: return "block_lists";
    case Format::varlen_block_lists: return "varlen_block_lists";
    case Format::bsr: return "bsr";
    case Format::bitmask: return "bitmask";
  }
  return "?";
}

const char* to_string(Proxy proxy) {
  switch (proxy) {
    case Proxy::off: return "off";
    case Proxy::eligible: return "eligible";
    case Proxy::explicit_set: return "explicit_set";
  }
  return "?";
}

std::size_t element_size(DType dtype) {
  return (dtype == DType::f16 || dtype == DType::bf16) ? 2 : 4;
}

namespace {
TensorView make(const void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device,
                int device_index) {
  if (shape.size() > static_cast<std::size_t>(TensorView::kMaxRank))
    throw Error("tensor", "rank " + std::to_string(shape.size()) + " exceeds 5");
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  if (!t.data && t.rank > 0 && t.numel() == 0) t.data = TensorView::empty_address();
  return t;
}
}  // namespace

void* TensorView::empty_address() {
  alignas(256) static char address;  // aligned as any tensor must be
  return &address;
}

TensorView TensorView::contiguous(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device, int device_index) {
  TensorView t = make(data, dtype, shape, device, device_index);
  std::int64_t s = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.stride[i] = s;
    s *= t.shape[i];
  }
  return t;
}

TensorView TensorView::strided(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> stride, Device device, int device_index) {
  if (stride.size() != shape.size())
    throw Error("tensor", "strides have rank " + std::to_string(stride.size()) + " but shape has rank " +
                              std::to_string(shape.size()));
  TensorView t = make(data, dtype, shape, device, device_index);
  int i = 0;
  for (std::int64_t s : stride) t.stride[i++] = s;
  return t;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace bsattn
