// The buffers and element-wise work of one context-parallel call (context_parallel.cpp), on the
// tensors' device: host memory and loops on the CPU; on a GPU, stream-ordered allocations,
// copies and kernels on the call's stream (nothing here waits for the GPU but to_host()).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "bsattn/distributed.hpp"

namespace bsattn::distributed {

class Scratch {
 public:
  // Makes the device current for the Scratch's lifetime (GPU).
  Scratch(Device device, int device_index, Stream stream);
  ~Scratch();  // frees every buffer (GPU: in stream order)
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  Transport::Memory memory() const { return {device_, device_index_, stream_}; }
  // A buffer that lives as long as the Scratch.
  void* allocate(std::size_t bytes);
  float* floats(std::size_t count) { return static_cast<float*>(allocate(count * sizeof(float))); }
  float* filled(std::size_t count, float value);
  // `bytes` of host memory into a buffer (the host memory may be reused when this returns).
  void upload(void* dst, const void* host, std::size_t bytes);
  // Tokens [begin, begin + tokens) of every batch of K or V [B, S, H, D], packed [B, tokens, H, D].
  void pack(const TensorView& kv, std::int64_t begin, std::int64_t tokens, void* dst);
  void add(float* dst, const float* src, std::size_t count);  // dst += src
  // Contiguous fp32 of dst's shape into dst (rank 4, f32 / f16 / bf16, last dimension contiguous).
  void store(const float* src, const TensorView& dst);
  // A host view of `t` (host memory: t itself; device memory: a copy with t's strides in `keep`,
  // read once the stream has reached this call, which waits for it).
  TensorView to_host(const TensorView& t, std::vector<unsigned char>& keep);

 private:
  struct Device_;  // the GPU's current-device scope
  Device device_;
  int device_index_;
  Stream stream_;
  std::unique_ptr<Device_> current_;
  std::vector<std::unique_ptr<unsigned char[]>> host_;
  std::vector<void*> device_buffers_;
};

}  // namespace bsattn::distributed
