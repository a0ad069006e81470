// Block selection on the GPU (SPEC §7): the kernel's bitmask equals the CPU engine's bit for bit on
// random cases (every policy and forced option, batched and varlen, GQA heads = q and kv, f32 /
// f16 / bf16, ties, up to thousands of KV blocks), with every output word poisoned before the run
// and so checked written (padding words and varlen padding rows included).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "gpu_case.hpp"
#include "select_case.hpp"

namespace bsattn_gpu_test {
namespace {

using bsattn_test::SelectCase;

// Device copy of one host tensor, viewed with the host view's shape and strides.
struct DeviceCopy {
  void* data = nullptr;
  TensorView view;
  DeviceCopy(const TensorView& host, std::size_t bytes) {
    view = host;
    if (!host.defined()) return;
    cudaMalloc(&data, bytes);
    cudaMemcpy(data, host.data, bytes, cudaMemcpyHostToDevice);
    view.data = data;
    view.device = Device::cuda;
  }
  ~DeviceCopy() {
    if (data) cudaFree(data);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

// "" when the GPU writes the CPU's bitmask.
std::string compare_with_cpu(SelectCase& c, bool validate, cudaStream_t stream) {
  c.problem.num_threads = 0;  // every core for the long cases
  bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
  const std::vector<std::uint32_t> expected = c.bits;

  c.poison();
  DeviceCopy q(c.inputs.q, c.q.size()), ks(c.inputs.k_summary, c.k_summary.size()),
      cu_q(c.inputs.cu_seqlens_q, c.cu_q.size() * 4), cu_k(c.inputs.cu_seqlens_k, c.cu_k.size() * 4),
      bits(c.bits_view, c.bits.size() * 4);
  Problem p = c.problem;
  p.device = Device::cuda;
  p.validate = validate;
  Inputs in;
  in.q = q.view;
  in.k_summary = ks.view;
  in.cu_seqlens_q = cu_q.view;
  in.cu_seqlens_k = cu_k.view;
  bsattn::select_blocks(p, in, c.options, bits.view, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) return c.describe() + ": kernel failed";
  cudaMemcpy(c.bits.data(), bits.data, c.bits.size() * 4, cudaMemcpyDeviceToHost);
  for (std::size_t i = 0; i < expected.size(); ++i)
    if (c.bits[i] != expected[i])
      return c.describe() + ": word " + std::to_string(i) + " is " + std::to_string(c.bits[i]) + " on the GPU, " +
             std::to_string(expected[i]) + " on the CPU" + (c.bits[i] == SelectCase::kPoison ? " (not written)" : "");
  return "";
}

class GpuSelectTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSelectTest, EqualsCpuBitForBit) {
  REQUIRE_SM90();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const int i = GetParam();
  SelectCase c;
  // Every third case long: hundreds to thousands of KV blocks (multi-chunk sums, wide sorts).
  bsattn_test::make_select_case(c, 8100000 + static_cast<std::uint64_t>(i), i % 3, i % 3 == 2 ? 3000 + 400 * (i % 50) : 0);
  const std::string failure = compare_with_cpu(c, i % 2 == 0, stream);
  EXPECT_TRUE(failure.empty()) << failure;
  CUDA_OK(cudaStreamDestroy(stream));
}
INSTANTIATE_TEST_SUITE_P(Random, GpuSelectTest, ::testing::Range(0, 300));

}  // namespace
}  // namespace bsattn_gpu_test
