#include "distributed/scratch.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "bsattn/cpu/engine.hpp"
#include "formats/bind.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/device_guard.hpp"
#include "gpu/elementwise.hpp"
#endif

namespace bsattn::distributed {

#if BSATTN_WITH_CUDA
struct Scratch::Device_ {
  explicit Device_(int index) : guard(index) {}
  gpu::DeviceGuard guard;
};
namespace {
cudaStream_t cuda(Stream s) { return static_cast<cudaStream_t>(s); }
}  // namespace
#else
struct Scratch::Device_ {};
#endif

Scratch::Scratch(Device device, int device_index, Stream stream)
    : device_(device), device_index_(device_index), stream_(stream) {
  if (device_ == Device::cpu) return;
#if BSATTN_WITH_CUDA
  current_ = std::make_unique<Device_>(device_index);
#else
  throw Error("problem.device", "cuda:" + std::to_string(device_index) +
                                    ", but this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use CPU tensors");
#endif
}

Scratch::~Scratch() {
#if BSATTN_WITH_CUDA
  for (void* p : device_buffers_) cudaFreeAsync(p, cuda(stream_));
#endif
}

void* Scratch::allocate(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  if (device_ == Device::cpu) {
    host_.push_back(std::make_unique<unsigned char[]>(bytes));
    return host_.back().get();
  }
#if BSATTN_WITH_CUDA
  void* p = nullptr;
  gpu::cuda_check(cudaMallocAsync(&p, bytes, cuda(stream_)), "cudaMallocAsync (context-parallel buffers)");
  device_buffers_.push_back(p);
  return p;
#else
  return nullptr;
#endif
}

float* Scratch::filled(std::size_t count, float value) {
  float* p = floats(count);
  if (device_ == Device::cpu) {
    std::fill_n(p, count, value);
    return p;
  }
#if BSATTN_WITH_CUDA
  gpu::cuda_check(gpu::fill_f32(p, value, static_cast<std::int64_t>(count), cuda(stream_)), "fill kernel launch");
#endif
  return p;
}

void Scratch::upload(void* dst, const void* host, std::size_t bytes) {
  if (bytes == 0) return;  // an empty host vector's data() may be null
  if (device_ == Device::cpu) {
    std::memcpy(dst, host, bytes);
    return;
  }
#if BSATTN_WITH_CUDA
  // From pageable memory the call returns once the bytes are staged: `host` may go then.
  gpu::cuda_check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, cuda(stream_)), "cudaMemcpyAsync (upload)");
#endif
}

void Scratch::pack(const TensorView& kv, std::int64_t begin, std::int64_t tokens, void* dst) {
  const std::size_t es = element_size(kv.dtype);
  auto* to = static_cast<unsigned char*>(dst);
  const auto* from = static_cast<const unsigned char*>(kv.data);
  if (device_ == Device::cpu) {
    const std::size_t head = static_cast<std::size_t>(kv.shape[3]) * es;
    for (std::int64_t b = 0; b < kv.shape[0]; ++b)
      for (std::int64_t t = begin; t < begin + tokens; ++t)
        for (std::int64_t h = 0; h < kv.shape[2]; ++h, to += head)
          std::memcpy(to, from + (b * kv.stride[0] + t * kv.stride[1] + h * kv.stride[2]) * es, head);
    return;
  }
#if BSATTN_WITH_CUDA
  // A token's heads are contiguous (checked by the caller): one 2D copy per batch.
  const std::size_t row = static_cast<std::size_t>(kv.shape[2] * kv.shape[3]) * es;
  for (std::int64_t b = 0; b < kv.shape[0]; ++b)
    gpu::cuda_check(cudaMemcpy2DAsync(to + b * tokens * row, row, from + (b * kv.stride[0] + begin * kv.stride[1]) * es,
                                      static_cast<std::size_t>(kv.stride[1]) * es, row,
                                      static_cast<std::size_t>(tokens), cudaMemcpyDeviceToDevice, cuda(stream_)),
                    "cudaMemcpy2DAsync (K/V chunk)");
#endif
}

void Scratch::add(float* dst, const float* src, std::size_t count) {
  if (device_ == Device::cpu) {
    for (std::size_t i = 0; i < count; ++i) dst[i] += src[i];
    return;
  }
#if BSATTN_WITH_CUDA
  gpu::cuda_check(gpu::add_f32(dst, src, static_cast<std::int64_t>(count), cuda(stream_)), "add kernel launch");
#endif
}

void Scratch::store(const float* src, const TensorView& dst) {
  if (device_ == Device::cpu) {
    const ElementType type = formats::element_type(dst.dtype);
    const std::int64_t n3 = dst.shape[3];
    for (std::int64_t i0 = 0; i0 < dst.shape[0]; ++i0)
      for (std::int64_t i1 = 0; i1 < dst.shape[1]; ++i1)
        for (std::int64_t i2 = 0; i2 < dst.shape[2]; ++i2, src += n3)
          cpu::detail::store_row(dst.data, i0 * dst.stride[0] + i1 * dst.stride[1] + i2 * dst.stride[2],
                                 static_cast<int>(n3), type, src);
    return;
  }
#if BSATTN_WITH_CUDA
  gpu::cuda_check(gpu::store_f32(src, dst, cuda(stream_)), "store kernel launch");
#endif
}

TensorView Scratch::to_host(const TensorView& t, std::vector<unsigned char>& keep) {
  if (!t.defined() || t.device == Device::cpu) return t;
  TensorView host = t;
#if BSATTN_WITH_CUDA
  std::int64_t span = 1;  // elements from the first to the last one, inclusive
  for (int d = 0; d < t.rank; ++d) span += (t.shape[d] - 1) * t.stride[d];
  if (t.numel() == 0) span = 0;
  keep.resize(static_cast<std::size_t>(span) * element_size(t.dtype));
  gpu::DeviceGuard guard(t.device_index);
  gpu::cuda_check(cudaMemcpyAsync(keep.data(), t.data, keep.size(), cudaMemcpyDeviceToHost, cuda(stream_)),
                  "cudaMemcpyAsync (block pattern to the host)");
  gpu::cuda_check(cudaStreamSynchronize(cuda(stream_)), "cudaStreamSynchronize (block pattern)");
  host.data = keep.data();
  host.device = Device::cpu;
#else
  (void)keep;
#endif
  return host;
}

}  // namespace bsattn::distributed
