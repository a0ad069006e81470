// Block selection on the GPU (SPEC §7): the kernel's bitmask equals the CPU engine's bit for bit on
// random cases (every policy and forced option, batched and varlen, GQA heads = q and kv, f32 /
// f16 / bf16, ties, up to thousands of KV blocks), with every output word poisoned before the run
// and so checked written (padding words and varlen padding rows included); and a CUDA graph of the
// call replayed with new Q values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
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
      lens(c.inputs.seq_lens_kv, c.seq_lens_kv.size() * 4), table(c.inputs.block_table, c.block_table.size() * 4),
      bits(c.bits_view, c.bits.size() * 4);
  Problem p = c.problem;
  p.device = Device::cuda;
  p.validate = validate;
  Inputs in;
  in.q = q.view;
  in.k_summary = ks.view;
  in.cu_seqlens_q = cu_q.view;
  in.cu_seqlens_k = cu_k.view;
  in.seq_lens_kv = lens.view;
  in.block_table = table.view;
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

// Long rows (about 190-630 KV blocks) for every policy with top_k drawn from [1, nKB]: the kernel's
// top_k search in registers (up to 512 blocks) and in shared memory (more), tau and mass over many
// chunks.
class GpuSelectLongTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSelectLongTest, EqualsCpuBitForBit) {
  REQUIRE_SM90();
  const int i = GetParam();
  SelectCase c;
  bsattn_test::make_long_select_case(c, 8500000 + static_cast<std::uint64_t>(i), i % 3);
  const std::string failure = compare_with_cpu(c, i % 2 == 0, nullptr);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, GpuSelectLongTest, ::testing::Range(0, 30));

// Paged KV lengths (seq_lens_kv), batched Q.
TEST(GpuSelectPaged, EqualsCpuBitForBit) {
  REQUIRE_SM90();
  int checked = 0;
  for (std::uint64_t seed = 8400000; checked < 30; ++seed) {
    SelectCase c;
    bsattn_test::make_select_case(c, seed);
    if (c.varlen()) continue;
    bsattn_test::make_paged(c, seed);
    const std::string failure = compare_with_cpu(c, checked % 2 == 0, nullptr);
    EXPECT_TRUE(failure.empty()) << failure;
    ++checked;
  }
}

// Captured in a CUDA graph (validate = false: no host sync) and replayed with new Q values: each
// replay writes the bits the CPU engine gives for the new values.
TEST(GpuSelectGraph, ReplaysWithNewQueries) {
  REQUIRE_SM90();
  SelectCase c;
  bsattn_test::make_select_case(c, 8300000, 2);
  c.problem.num_threads = 0;
  DeviceCopy q(c.inputs.q, c.q.size()), ks(c.inputs.k_summary, c.k_summary.size()),
      cu_q(c.inputs.cu_seqlens_q, c.cu_q.size() * 4), cu_k(c.inputs.cu_seqlens_k, c.cu_k.size() * 4),
      bits(c.bits_view, c.bits.size() * 4);
  Problem p = c.problem;
  p.device = Device::cuda;
  p.validate = false;
  Inputs in;
  in.q = q.view;
  in.k_summary = ks.view;
  in.cu_seqlens_q = cu_q.view;
  in.cu_seqlens_k = cu_k.view;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  bsattn::select_blocks(p, in, c.options, bits.view, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::mt19937_64 rng(5);
  for (int replay = 0; replay < 3; ++replay) {
    bsattn_test::fill_random(c.q, static_cast<std::int64_t>(c.q.size() / element_size(c.problem.dtype)), c.problem.dtype,
                             rng, 0.1 * replay);
    c.inputs.q.data = c.q.data();
    c.poison();
    bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
    const std::vector<std::uint32_t> expected = c.bits;
    CUDA_OK(cudaMemcpy(q.data, c.q.data(), c.q.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(bits.data, 0xab, c.bits.size() * 4));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(c.bits.data(), bits.data, c.bits.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(c.bits == expected) << c.describe() << ", replay " << replay;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace bsattn_gpu_test
