// The GPU call path (issue 14.3): the tensor-map memo gives exactly the driver's maps and
// re-encodes on any changed address or stride, and one plan run on changing tensors (new addresses,
// new values behind the same addresses, another stream, an offset base) gives each call its own
// result, checked against the CPU engine with outputs poisoned before every run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/fwd/tensor_map_memo.hpp"
#include "gpu_case.hpp"

namespace bsattn_gpu_test {
namespace {

using bsattn::gpu::fwd::driver_encode_tiled;
using bsattn::gpu::fwd::encode_tiled_memo;

// One 4-D bf16 map (D, tokens, heads, batch) with 128-byte swizzled boxes of 64 x rows.
struct MapArgs {
  void* base;
  cuuint64_t dims[4];
  cuuint64_t strides[3];
  cuuint32_t box[4];
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
};

CUresult encode_with(bsattn::gpu::fwd::EncodeTiled encode, const MapArgs& m, CUtensorMap& map) {
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, m.base, m.dims, m.strides, m.box, m.element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

TEST(GpuCallPath, TensorMapMemoGivesTheDriverMap) {
  REQUIRE_SM90();
  ASSERT_NE(driver_encode_tiled(), nullptr);
  void* buffer = nullptr;
  CUDA_OK(cudaMalloc(&buffer, 64 << 20));
  std::mt19937_64 rng(14);
  std::vector<MapArgs> cases;
  for (int i = 0; i < 40; ++i) {
    const cuuint64_t d = 64u << (rng() % 3), tokens = 1 + rng() % 3000, heads = 1 + rng() % 8, batch = 1 + rng() % 3;
    const cuuint64_t token_stride = (heads * d + 8 * (rng() % 3)) * 2;  // padded token rows, 16-byte multiples
    MapArgs m{static_cast<char*>(buffer) + 256 * (rng() % 64), {d, tokens, heads, batch},
              {token_stride, d * 2, token_stride * tokens}, {64, rng() % 2 ? 64u : 128u, 1, 1}};
    cases.push_back(m);
    cases.push_back(m);  // the same arguments again: a memo hit
    m.base = static_cast<char*>(m.base) + 16;  // another address
    cases.push_back(m);
    m.strides[0] += 16;  // another stride
    m.strides[2] = m.strides[0] * tokens;
    cases.push_back(m);
  }
  for (int pass = 0; pass < 2; ++pass)  // the second pass meets some slots already filled
    for (std::size_t i = 0; i < cases.size(); ++i) {
      CUtensorMap want{}, got{};
      ASSERT_EQ(encode_with(driver_encode_tiled(), cases[i], want), CUDA_SUCCESS) << i;
      std::memset(&got, 0xab, sizeof got);
      ASSERT_EQ(encode_with(&encode_tiled_memo, cases[i], got), CUDA_SUCCESS) << i;
      EXPECT_EQ(std::memcmp(&want, &got, sizeof want), 0) << "case " << i << " pass " << pass;
    }
  // A rejected encode (base not 16-byte aligned) is reported, not memoised.
  MapArgs bad = cases[0];
  bad.base = static_cast<char*>(bad.base) + 2;
  CUtensorMap map{};
  EXPECT_NE(encode_with(&encode_tiled_memo, bad, map), CUDA_SUCCESS);
  EXPECT_NE(encode_with(&encode_tiled_memo, bad, map), CUDA_SUCCESS);
  CUDA_OK(cudaFree(buffer));
}

// A device copy of host bytes at `offset` bytes into its own allocation.
struct DeviceCopy {
  void* allocation = nullptr;
  void* data = nullptr;
  DeviceCopy(const std::vector<unsigned char>& host, std::size_t offset) {
    cudaMalloc(&allocation, host.size() + offset);
    data = static_cast<char*>(allocation) + offset;
    cudaMemcpy(data, host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  ~DeviceCopy() { cudaFree(allocation); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

void fill_random(Buffer& b, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  auto* bits = reinterpret_cast<std::uint16_t*>(b.host.data());
  for (std::size_t i = 0; i < b.host.size() / 2; ++i) bits[i] = to_bits(normal(rng), b.dtype);
}

// One run of `plan` on the device tensors (outputs poisoned first) against the CPU engine on the
// case's host tensors, which hold the same values.
void expect_matches_cpu(Case& c, const Inputs& device_inputs, const Outputs& device_outputs, Plan& plan,
                        cudaStream_t stream, const char* what) {
  SCOPED_TRACE(what);
  Buffer& out_host = *c.out;
  Buffer& lse_host = *c.lse;
  CUDA_OK(cudaMemsetAsync(device_outputs.out.data, 0xff, out_host.bytes(), stream));
  CUDA_OK(cudaMemsetAsync(device_outputs.lse.data, 0xff, lse_host.bytes(), stream));
  plan.run(device_inputs, device_outputs, stream);
  plan.check(stream);
  std::vector<unsigned char> out_bytes(out_host.bytes()), lse_bytes(lse_host.bytes());
  CUDA_OK(cudaMemcpy(out_bytes.data(), device_outputs.out.data, out_bytes.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse_bytes.data(), device_outputs.lse.data, lse_bytes.size(), cudaMemcpyDeviceToHost));

  Problem p = c.problem;
  p.device = Device::cpu;
  Plan cpu(p);
  std::fill(out_host.host.begin(), out_host.host.end(), 0xff);
  std::fill(lse_host.host.begin(), lse_host.host.end(), 0xff);
  cpu.run(c.in_host, c.out_host);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < out_bytes.size() / 2; ++i) {
    const float r = load_out(&out_host, i);
    std::uint16_t g_bits;
    std::memcpy(&g_bits, out_bytes.data() + 2 * i, 2);
    const float g = c.problem.out_dtype == DType::bf16 ? cpu::bf16_to_float(g_bits) : cpu::half_to_float(g_bits);
    if (!std::isfinite(g) || std::fabs(g - r) > 0.03f + 0.02f * std::fabs(r)) ++bad;
  }
  EXPECT_EQ(bad, 0u) << "outputs differing from the CPU engine";
  std::size_t lse_bad = 0;
  for (std::size_t i = 0; i < lse_bytes.size() / 4; ++i) {
    float g, r;
    std::memcpy(&g, lse_bytes.data() + 4 * i, 4);
    std::memcpy(&r, lse_host.host.data() + 4 * i, 4);
    const bool ok = std::isinf(r) ? (std::isinf(g) && g < 0) : std::fabs(g - r) <= 2e-3f + 1e-4f * std::fabs(r);
    if (!ok) ++lse_bad;
  }
  EXPECT_EQ(lse_bad, 0u) << "LSE values differing from the CPU engine";
}

TEST(GpuCallPath, OnePlanFollowsNewAddressesValuesAndStreams) {
  REQUIRE_SM90();
  CaseSpec spec;
  spec.format = Format::all_blocks;
  spec.mask = 1;  // causal
  spec.batch = 2;
  spec.hq = 8;
  spec.hkv = 2;
  spec.seed = 1414;
  auto c = make_case(spec);
  SCOPED_TRACE(c->name);
  ASSERT_NE(c->lse, nullptr);
  Problem p = c->problem;
  p.validate = false;
  Plan plan(p);
  cudaStream_t side = nullptr;
  CUDA_OK(cudaStreamCreate(&side));

  expect_matches_cpu(*c, c->in_device, c->out_device, plan, nullptr, "first run");
  std::mt19937_64 rng(7);
  for (Buffer* b : {c->q, c->k, c->v}) {  // new values behind the same addresses (a memo hit)
    fill_random(*b, rng);
    b->upload();
  }
  expect_matches_cpu(*c, c->in_device, c->out_device, plan, nullptr, "same addresses, new values");

  // Every tensor at a new address (one of them 16 bytes past an allocation's start), new values.
  for (Buffer* b : {c->q, c->k, c->v}) fill_random(*b, rng);
  DeviceCopy q(c->q->host, 16), k(c->k->host, 0), v(c->v->host, 256), out(c->out->host, 0), lse(c->lse->host, 0);
  Inputs moved = c->in_device;
  moved.q.data = q.data;
  moved.k.data = k.data;
  moved.v.data = v.data;
  Outputs moved_out = c->out_device;
  moved_out.out.data = out.data;
  moved_out.lse.data = lse.data;
  expect_matches_cpu(*c, moved, moved_out, plan, nullptr, "new addresses");
  expect_matches_cpu(*c, moved, moved_out, plan, side, "new addresses, another stream");
  // Back to the first addresses (their device bytes still hold the previous values).
  for (Buffer* b : {c->q, c->k, c->v}) b->upload();
  expect_matches_cpu(*c, c->in_device, c->out_device, plan, side, "first addresses again");
  CUDA_OK(cudaStreamDestroy(side));
}

// A plan skips the structural checks for views identical to the latest checked ones; any changed
// view is checked again and refused before anything is written.
TEST(GpuCallPath, ChangedViewsAreCheckedAgain) {
  REQUIRE_SM90();
  CaseSpec spec;
  spec.format = Format::all_blocks;
  spec.mask = 1;
  spec.batch = 1;
  spec.seed = 1415;
  auto c = make_case(spec);
  Problem p = c->problem;
  p.validate = false;
  Plan plan(p);
  plan.run(c->in_device, c->out_device, nullptr);
  plan.run(c->in_device, c->out_device, nullptr);  // identical views
  plan.check(nullptr);
  const auto expect_refused = [&](const Inputs& in, const Outputs& out, const std::string& argument) {
    CUDA_OK(cudaMemset(c->out->device, 0xff, c->out->bytes()));
    try {
      plan.run(in, out, nullptr);
      ADD_FAILURE() << "run() accepted a bad " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<unsigned char> bytes(c->out->bytes());
    CUDA_OK(cudaMemcpy(bytes.data(), c->out->device, bytes.size(), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](unsigned char b) { return b == 0xff; }))
        << "a refused run wrote output";
  };
  Inputs misaligned = c->in_device;  // same shapes and strides, base 2 bytes off
  misaligned.q.data = static_cast<char*>(misaligned.q.data) + 2;
  expect_refused(misaligned, c->out_device, "q");
  Outputs aliased = c->out_device;  // the output over K
  aliased.out.data = c->in_device.k.data;
  expect_refused(c->in_device, aliased, "outputs.out");  // refused before any write
  expect_matches_cpu(*c, c->in_device, c->out_device, plan, nullptr, "the checked views again");
}

}  // namespace
}  // namespace bsattn_gpu_test
